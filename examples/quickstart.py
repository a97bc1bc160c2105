"""The Python API in one screen: build a pipeline, run it, read its stats.

    python examples/quickstart.py
"""

import tailrace as tr


def running_total(total, x):
    total = (total or 0) + x
    return total, total


def main() -> list:
    p = tr.Pipeline("quickstart")
    numbers = p.source(range(10))
    evens, odds = numbers.branch(lambda x: x % 2 == 0, id="parity")
    doubled = evens.map(lambda x: 2 * x, id="double")
    tripled = odds.map(lambda x: 3 * x, id="triple")
    merged = doubled.merge(tripled, id="merge")
    totals = merged.key_by(lambda x: "even" if x % 2 == 0 else "odd").stateful(running_total)
    totals.sink(out := [])

    result = tr.run(p)
    print(result.plan.render())
    print(sorted(out))
    print(tr.format_stats(result.stats))
    return out


if __name__ == "__main__":
    main()
