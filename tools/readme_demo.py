"""Write what `make demo` prints into README.md (`make readme`), so its sample cannot go
stale: the block between the ``demo-output`` markers is replaced by a real run's output.
tests/cli/test_demo.py checks that the answers in README.md are what the demo prints.

    .venv/bin/python tools/readme_demo.py [README.md]
"""

from __future__ import annotations

import contextlib
import io
import os
import platform
import sys
import time
from pathlib import Path

from tailrace.cli.demo import demo

BEGIN = "<!-- demo-output: written by `make readme` from a real run; do not edit -->"
END = "<!-- /demo-output -->"


def splice(readme: str, block: str) -> str:
    """``readme`` with the text between the markers replaced by ``block``; ValueError if
    the markers are missing or out of order."""
    i, j = readme.find(BEGIN), readme.find(END)
    if i < 0 or j < i:
        raise ValueError(f"README has no {BEGIN!r} ... {END!r} block")
    return readme[:i + len(BEGIN)] + "\n" + block + "\n" + readme[j:]


def main() -> int:
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "README.md")
    out = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(out):
        code = demo()
    if code != 0:
        print(out.getvalue())
        print("the demo failed: README.md left as it was", file=sys.stderr)
        return code
    machine = f"{platform.machine()}, {os.cpu_count()} cores"
    block = (f"Real output ({machine}; {time.strftime('%Y-%m-%d')}, "
             f"{time.perf_counter() - t0:.0f} s with the index cached):\n\n```\n"
             f"{out.getvalue().rstrip()}\n```")
    path.write_text(splice(path.read_text(encoding="utf-8"), block), encoding="utf-8")
    print(f"{path}: demo output updated", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
