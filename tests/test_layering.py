"""The layering of ``src/tailrace``, pinned: which package may import which, and no
module reaching into another module's private names. Read from the source (every
``import``, including the lazy ones inside functions), so a new upward import fails here
before it becomes a cycle or a hidden coupling."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "src" / "tailrace"

BASE = {"errors", "registry", "api", "request"}
#: package -> the tailrace packages it may import (besides itself). Top to bottom:
#: cli -> serving -> runtime -> compiler -> operators -> control/stores -> engines -> api.
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "registry": set(),
    "request": set(),  # the typed request envelope: imports nothing of tailrace
    "api": {"errors"},
    "observability": {"errors", "api", "request"},
    "engines": BASE,
    "stores": BASE | {"engines"},
    "control": BASE | {"engines"},  # admission only; tokens, never the pool's insides
    "operators": BASE | {"engines", "stores", "control", "observability"},
    "compiler": BASE | {"operators", "observability"},
    # control: the Ray gate actor (runtime/ray/gate.py) hosts an admission policy
    "runtime": BASE | {"compiler", "operators", "control", "engines", "observability"},
    "serving": BASE | {"runtime", "compiler", "operators", "control", "engines", "stores",
                       "observability"},
    "cli": BASE | {"serving", "runtime", "compiler", "operators", "control", "engines",
                   "stores", "observability"},
    "demo": BASE,
}


def _imports(path: Path) -> list[tuple[list[str], list[str], int]]:
    """(imported module as parts, names taken from it, line) for every import of a file."""
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    is_pkg = parts[-1] == "__init__"
    here = parts[:-1] if is_pkg else parts
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - node.level + (1 if is_pkg else 0)]
                mod = base + (node.module.split(".") if node.module else [])
            else:
                mod = (node.module or "").split(".")
            out.append((mod, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            out.extend((a.name.split("."), [], node.lineno) for a in node.names)
    return out


def _package(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 else rel.stem


FILES = sorted(p for p in ROOT.rglob("*.py") if p.name != "__init__.py" or p.parent != ROOT)


def test_the_file_list_is_not_empty():
    assert len(FILES) > 50 and all(_package(f) in ALLOWED for f in FILES), \
        sorted({_package(f) for f in FILES} - set(ALLOWED))


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_follow_the_layers(path):
    pkg = _package(path)
    bad = []
    for mod, _, line in _imports(path):
        if mod[:1] != ["tailrace"] or len(mod) < 2 or mod[1] == pkg:
            continue
        if mod[1] not in ALLOWED[pkg]:
            bad.append(f"line {line}: {pkg} imports {'.'.join(mod)}")
        if pkg == "control" and mod[1] == "engines" and mod[2:3] == ["pool"]:
            bad.append(f"line {line}: control imports the engine pool ({'.'.join(mod)})")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_private_names_from_another_module(path):
    bad = [f"line {line}: from {'.'.join(mod)} import {name}"
           for mod, names, line in _imports(path) if mod[:1] == ["tailrace"]
           for name in names if name.startswith("_") and not name.startswith("__")]
    assert not bad, "\n".join(bad)


HEAVY = {"ray", "llama_cpp", "faiss", "onnxruntime", "numpy", "torch", "fastapi"}


def test_api_imports_nothing_heavy():
    for path in (ROOT / "api").rglob("*.py"):
        for mod, _, line in _imports(path):
            assert mod[0] not in HEAVY, f"{path.name}:{line} imports {'.'.join(mod)}"


def test_nothing_below_the_cli_imports_the_top_level_package():
    bad = [f"{f.relative_to(ROOT)}:{line}" for f in FILES for mod, _, line in _imports(f)
           if mod == ["tailrace"] and _package(f) != "cli"]  # the CLI reads __version__
    assert not bad, bad


def test_the_checker_sees_an_upward_and_a_private_import(tmp_path, monkeypatch):
    # the checks above are only as good as the parser: show it catches both kinds
    fake = tmp_path / "tailrace"
    (fake / "engines").mkdir(parents=True)
    src = fake / "engines" / "bad.py"
    src.write_text("from ..runtime import run\nfrom ..control.gate import _private\n")
    monkeypatch.setattr(f"{__name__}.ROOT", fake)
    with pytest.raises(AssertionError, match="engines imports tailrace.runtime"):
        test_imports_follow_the_layers(src)
    with pytest.raises(AssertionError, match="import _private"):
        test_no_private_names_from_another_module(src)
