"""The child process of the Ctrl-C test: runs one scenario on its main thread, where the
SIGINT an operator sends reaches ``tr.run`` as it would from a terminal, and prints the
problems found as one JSON line.

    python -m tests.fault.interrupt "Scenario(n=3, seed=0, steps=(Step('map'),), ...)"
"""

from __future__ import annotations

import json
import sys

from . import harness
from .runners import run_local


def main() -> None:
    names = {k: getattr(harness, k) for k in ("Scenario", "Step", "Faults", "Admission")}
    sc = eval(sys.argv[1], names)  # the repr of a Scenario, from the test
    report = run_local(sc, here=True)
    print(json.dumps({"problems": report.problems, "interrupted": report.interrupted}))


if __name__ == "__main__":
    main()
