"""The layering of ``src/tailrace``, pinned: which package may import which, no module
reaching into another module's private names, no hook in a lower layer filled from
above, no import-time side effects. Read from the source (every ``import``, including
the lazy ones inside functions), so a new upward import fails here before it becomes a
cycle or a hidden coupling."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
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
    "verify": BASE,  # verifiers and their sandbox: used by operators (verify, route)
    "routing": BASE | {"engines", "verify"},  # training a collaborative router
    "operators": BASE | {"engines", "stores", "control", "observability", "verify"},
    "compiler": BASE | {"operators", "observability"},
    # control: the Ray gate actor (runtime/ray/gate.py) hosts an admission policy; see
    # test_control_sits_below_runtime
    "runtime": BASE | {"compiler", "operators", "control", "engines", "observability"},
    "serving": BASE | {"runtime", "compiler", "operators", "control", "engines", "stores",
                       "observability"},
    # the capacity simulator drives the real control, engine pools and compiled plans,
    # and builds its admission policy as serving does (binding.admission_setup)
    "simulate": BASE | {"serving", "compiler", "operators", "control", "engines",
                        "observability"},
    "cli": BASE | {"serving", "runtime", "compiler", "operators", "control", "engines",
                   "stores", "observability", "routing", "simulate"},
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


def test_control_sits_below_runtime():
    # the one rule for control/ (docs/architecture.md): runtime may import control (the
    # cluster gate actor hosts a policy); control never imports runtime nor what is above
    assert "control" in ALLOWED["runtime"]
    above = {"runtime", "compiler", "operators", "serving", "cli", "observability"}
    assert not ALLOWED["control"] & above, ALLOWED["control"] & above
    bad = [f"{f.relative_to(ROOT)}:{line} imports {'.'.join(mod)}"
           for f in FILES if _package(f) == "control" for mod, _, line in _imports(f)
           if mod[:1] == ["tailrace"] and mod[1:2] and mod[1] in above]
    assert not bad, bad
    # and the Ray runtime does host one (the rule is not idle)
    gate = ROOT / "runtime" / "ray" / "gate.py"
    assert any(mod[:2] == ["tailrace", "control"] for mod, _, _ in _imports(gate))


_NO_SIDE_EFFECTS = """
import atexit
registered = []
def register(fn, *a, **k):  # what tailrace registers (logging, say, has its own)
    if getattr(fn, "__module__", "").startswith("tailrace"):
        registered.append(f"{fn.__module__}.{fn.__qualname__}")
    return fn
atexit.register = register
import tailrace.engines.pool, tailrace.engines, tailrace.stores.live_index, tailrace.operators
import tailrace.runtime, tailrace.serving
print(registered)
"""


def test_importing_registers_nothing_at_exit():
    # engine pools and live indexes close at exit, registered when the first one is made
    env = {**os.environ, "PYTHONPATH": str(ROOT.parent)}
    out = subprocess.run([sys.executable, "-c", _NO_SIDE_EFFECTS], capture_output=True,
                         text=True, timeout=120, env=env, check=True).stdout
    assert out.strip() == "[]", out


def test_a_registry_registers_its_close_at_exit_once_at_its_first_object(monkeypatch):
    import atexit

    from tailrace.registry import Registry

    registered: list = []
    monkeypatch.setattr(atexit, "register", registered.append)
    reg: Registry[list] = Registry("demo", close=list.clear, at_exit=True)
    assert registered == []
    reg.get("a", list)
    reg.get("b", list)
    reg.close_all()
    reg.get("c", list)
    assert registered == [reg.close_all]
    assert Registry("plain").get("k", list) == [] and registered == [reg.close_all]


def _setters(path: Path) -> list[str]:
    """Module-level functions that rebind a module global to one of their arguments: a
    hook another layer fills from outside (``def set_x(fn): global X; X = fn``)."""
    out = []
    for fn in ast.parse(path.read_text(), str(path)).body:
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        args = {a.arg for a in fn.args.args + fn.args.kwonlyargs + fn.args.posonlyargs}
        rebound = {n for node in ast.walk(fn) if isinstance(node, ast.Global)
                   for n in node.names}
        for node in ast.walk(fn):
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Name)
                    and node.value.id in args):
                hit = [t.id for t in node.targets if isinstance(t, ast.Name)
                       and t.id in rebound]
                out += [f"{path.relative_to(ROOT)}:{node.lineno} {fn.name} sets {h}"
                        for h in hit]
    return out


def test_no_module_keeps_a_hook_filled_from_outside():
    # what a lower layer needs from above is passed in (an operator's engine opener is in
    # its BuildContext), never set on the lower module by the one above
    from tailrace.engines import opener

    assert not hasattr(opener, "set_remote_opener")
    bad = [hit for f in FILES for hit in _setters(f)]
    assert not bad, bad


def test_the_hook_check_sees_a_setter(tmp_path, monkeypatch):
    fake = tmp_path / "tailrace"
    (fake / "engines").mkdir(parents=True)
    src = fake / "engines" / "hook.py"
    src.write_text("_HOOK = None\n\ndef set_hook(fn):\n    global _HOOK\n    _HOOK = fn\n")
    monkeypatch.setattr(f"{__name__}.ROOT", fake)
    assert _setters(src) == ["engines/hook.py:5 set_hook sets _HOOK"]
