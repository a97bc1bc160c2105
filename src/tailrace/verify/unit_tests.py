"""``unit_tests``: run a record's tests against the code in an answer (HumanEval style).

The program is assembled from the answer and the record, then run in the sandbox
(``sandbox.py``):

1. the code: the answer's first ```python (or unlabelled) fenced block, else its text;
2. if the code defines ``def <entry_point>(`` at top level it is a whole solution and
   follows the prompt's preamble (everything before the prompt's own ``def
   <entry_point>``: its imports and helper functions; only its import lines when the
   prompt has no such def); else it is a completion and follows the whole prompt;
3. the record's test code, then ``check(<entry_point>)`` when the tests define ``check``
   (HumanEval's ``def check(candidate)``; plain ``assert`` lines, as MBPP's, need none).

>>> print(program("```python\\ndef inc(x):\\n    return x + 1\\n```",
...               "import math\\n\\ndef inc(x):\\n    '''x + 1'''\\n",
...               "def check(f):\\n    assert f(1) == 2", "inc"))
import math
<BLANKLINE>
def inc(x):
    return x + 1
<BLANKLINE>
<BLANKLINE>
def check(f):
    assert f(1) == 2
<BLANKLINE>
<BLANKLINE>
check(inc)
<BLANKLINE>
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from .base import Verdict, Verifier, fenced_block, field_of
from .sandbox import Limits, run_program

_IMPORT = re.compile(r"^(?:import\s|from\s+\S+\s+import\s)")
_CHECK = re.compile(r"^def\s+check\s*\(", re.M)


def _defines(code: str, name: str) -> re.Match | None:
    return re.search(rf"^def\s+{re.escape(name)}\s*\(", code, re.M)


def code_of(answer: str) -> str:
    """The code in an answer: its first ```python / ``` block, else the whole text."""
    block = fenced_block(answer, ("python", "py", "python3", ""))
    return block if block is not None else answer


def program(answer: str, prompt: str, tests: str, entry_point: str | None) -> str:
    """The program that checks ``answer`` (see the module docstring)."""
    code = code_of(answer)
    if entry_point and _defines(code, entry_point):
        own = _defines(prompt, entry_point)
        head = prompt[:own.start()] if own else "\n".join(
            line for line in prompt.splitlines() if _IMPORT.match(line))
        body = (head.rstrip() + "\n\n" if head.strip() else "") + code.strip("\n")
    else:
        body = prompt + code
    call = f"check({entry_point})\n" if entry_point and _CHECK.search(tests) else ""
    return f"{body.rstrip()}\n\n\n{tests.strip()}\n\n\n{call}"


class UnitTests(Verifier):
    """Passes when the assembled program runs to its end in the sandbox."""

    name = "unit_tests"

    def __init__(self, tests: str = "test", entry_point: str | None = "entry_point",
                 prompt: str | None = "prompt", timeout_s: float = 10.0,
                 memory_mb: int = 512) -> None:
        self.tests, self.entry_point, self.prompt = tests, entry_point, prompt
        self.limits = Limits(timeout_s=float(timeout_s), memory_mb=int(memory_mb))
        self.fields = tuple(f for f in (tests, entry_point, prompt) if f)

    def program(self, answer: str, record: Mapping[str, Any]) -> str:
        """The program this verifier runs for ``answer`` and ``record``."""
        def get(f: str | None) -> str:
            return "" if f is None else str(field_of(record, f, self.name))

        return program(answer, get(self.prompt), get(self.tests),
                       get(self.entry_point) or None)

    async def __call__(self, answer: str, record: Mapping[str, Any]) -> Verdict:
        result = await run_program(self.program(answer, record), self.limits)
        return self.verdict(result.passed, result.reason)


OPTIONS = {"tests": "a field name", "entry_point": "a field name (or null)",
           "prompt": "a field name (or null)", "timeout_s": "seconds, > 0 and <= 600",
           "memory_mb": "an integer number of MiB, >= 64"}


def from_spec(spec: Any) -> UnitTests:
    """A ``UnitTests`` from its YAML value (a mapping of ``OPTIONS``, or null);
    ValueError saying what is wrong."""
    spec = {} if spec is None else spec
    if not isinstance(spec, Mapping):
        raise ValueError(f"takes a mapping of {', '.join(OPTIONS)}, got {spec!r:.60}")
    bad = sorted(set(spec) - set(OPTIONS))
    if bad:
        raise ValueError(f"unknown option '{bad[0]}' (options: {', '.join(OPTIONS)})")
    for key in ("tests", "entry_point", "prompt"):
        v = spec.get(key, key)
        if not (isinstance(v, str) and v) and not (v is None and key != "tests"):
            raise ValueError(f"'{key}' must be {OPTIONS[key]}, got {v!r:.60}")
    t = spec.get("timeout_s", 10.0)
    if isinstance(t, bool) or not isinstance(t, int | float) or not 0 < t <= 600:
        raise ValueError(f"'timeout_s' must be {OPTIONS['timeout_s']}, got {t!r:.60}")
    m = spec.get("memory_mb", 512)
    if isinstance(m, bool) or not isinstance(m, int) or m < 64:
        raise ValueError(f"'memory_mb' must be {OPTIONS['memory_mb']}, got {m!r:.60}")
    return UnitTests(**spec)
