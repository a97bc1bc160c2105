"""``python``: any function ``check(answer, record)`` as a verifier.

It returns a bool, ``(bool, reason)`` or a ``Verdict``, and may be async. A plain function
runs on the event loop, so a check that blocks (a request, a long computation) should be
an ``async def`` or hand its work to a thread itself.

>>> import asyncio
>>> v = PythonCheck(lambda answer, record: (answer == record["gold"], "compared to gold"))
>>> asyncio.run(v("4", {"gold": "4"})).ok
True
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from .base import Verdict, Verifier


def resolve(spec: Any) -> Callable[..., Any]:
    """A callable from itself, ``"module:function"`` or a dotted path
    ``"pkg.module.function"``; ValueError saying why not."""
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"takes 'module:function' or a callable, got {spec!r:.60}")
    module, sep, attr = spec.partition(":")
    if not sep:
        module, _, attr = spec.rpartition(".")
    if not module or not attr:
        raise ValueError(f"'{spec}' is not 'module:function' (like 'mypkg.checks:is_valid')")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"cannot import module '{module}' for '{spec}': {e}") from None
    obj: Any = mod
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"module '{module}' has no attribute '{attr}'") from None
    if not callable(obj):
        raise ValueError(f"'{spec}' is not callable")
    return obj


def _name(fn: Any) -> str:
    mod = getattr(fn, "__module__", None) or type(fn).__module__
    qual = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"python:{mod}.{qual}"


class PythonCheck(Verifier):
    """Calls ``fn(answer, record)``; its bool, ``(bool, reason)`` or ``Verdict`` (sync or
    awaited) is the verdict. ``fields``: the record fields it reads, if declared."""

    def __init__(self, fn: Any, fields: tuple[str, ...] = ()) -> None:
        self.fn = resolve(fn)
        self.name = _name(self.fn)
        self.fields = tuple(fields)

    async def __call__(self, answer: str, record: Mapping[str, Any]) -> Verdict:
        got = self.fn(answer, record)
        if inspect.isawaitable(got):
            got = await got
        if isinstance(got, Verdict):
            return got
        if isinstance(got, bool):
            return self.verdict(got, "passed" if got else "failed")
        if isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], bool):
            return self.verdict(got[0], str(got[1]))
        raise TypeError(f"verifier {self.name} returned {got!r:.60}; return a bool, "
                        "(bool, reason) or a Verdict")
