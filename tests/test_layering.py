"""Imports point down only (ARCHITECTURE.md §2): a lower layer never imports a higher one,
and api/ imports nothing heavy."""

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parents[1] / "src" / "tailrace"
# rank: higher may import lower (or equal); never the other way round
RANK = {"errors": 0, "observability": 1, "api": 2, "engines": 3, "stores": 3,
        "operators": 4, "compiler": 5, "runtime": 6, "control": 7, "serving": 8, "cli": 8,
        "demo": 8}
HEAVY = {"ray", "llama_cpp", "faiss", "onnxruntime", "numpy", "torch", "fastapi"}


def layer_of(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG).parts
    return rel[0].removesuffix(".py") if len(rel) > 1 or rel[0] != "__init__.py" else "top"


def imported_layers(path: pathlib.Path):
    tree = ast.parse(path.read_text())
    here = path.relative_to(PKG).parts[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(here[: len(here) - node.level + 1])
                mod = base + (node.module.split(".") if node.module else [])
                if mod:
                    yield mod[0], node.lineno
                else:
                    for a in node.names:
                        yield a.name, node.lineno
            elif node.module and node.module.split(".")[0] == "tailrace":
                parts = node.module.split(".")
                yield (parts[1] if len(parts) > 1 else "top"), node.lineno
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "tailrace":
                    yield (parts[1] if len(parts) > 1 else "top"), node.lineno


FILES = sorted(p for p in PKG.rglob("*.py") if layer_of(p) != "top")


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(PKG)) for p in FILES])
def test_no_upward_imports(path):
    layer = layer_of(path)
    for target, line in imported_layers(path):
        target = target.removesuffix(".py")
        assert target != "top", f"{path.name}:{line} imports the top-level package"
        if target in RANK and layer in RANK:
            assert RANK[target] <= RANK[layer], (
                f"{path.relative_to(PKG)}:{line}: layer '{layer}' imports higher layer "
                f"'{target}'")


def test_api_imports_nothing_heavy():
    for path in (PKG / "api").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            for n in names:
                assert n.split(".")[0] not in HEAVY, f"{path.name} imports {n}"


def test_checker_catches_an_upward_import(tmp_path):
    """The check itself can fail: an api module importing the runtime is flagged."""
    bad = PKG / "api" / "_tmp_bad_layer.py"
    bad.write_text("from ..runtime import run\n")
    try:
        with pytest.raises(AssertionError, match="layer 'api' imports higher layer 'runtime'"):
            test_no_upward_imports(bad)
    finally:
        bad.unlink()
