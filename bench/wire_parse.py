"""Parsing a chat completion request (``openai_wire.parse_chat``), the per-request cost the
wire adds before a pipeline sees a record: one user message, a 10-message conversation,
and a request offering two client tools. Median [min - max] of 3 runs, each the best of
5 repeats of 20,000 parses. Compare two trees by running this script with each on
``PYTHONPATH`` (bench/RESULTS.md, issue 27).

    python bench/wire_parse.py
"""

from __future__ import annotations

import statistics
import timeit

from tailrace.serving.openai_wire import parse_chat

ONE = {"model": "chat", "max_tokens": 8,
       "messages": [{"role": "user", "content": "What is the capital of France?"}]}
TEN = {"model": "chat", "messages": [{"role": "system", "content": "Be brief."}] + [
    {"role": r, "content": f"turn {i}"} for i, r in enumerate(["user", "assistant"] * 4)] + [
    {"role": "user", "content": "and now?"}]}
TOOLS = {**ONE, "tools": [{"type": "function", "function": {
    "name": n, "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                              "required": ["city"]}}} for n in ("weather", "time")]}


def per_parse_us(body: dict) -> list[float]:
    return [min(timeit.repeat(lambda: parse_chat(body), number=20_000, repeat=5))
            / 20_000 * 1e6 for _ in range(3)]


def main() -> None:
    cases = [("one user message", ONE), ("10-message conversation", TEN),
             ("two client tools", TOOLS)]
    for name, body in cases:
        try:
            t = per_parse_us(body)
        except Exception as e:  # noqa: BLE001 - an older tree refuses tools
            print(f"{name:26s} refused: {type(e).__name__}: {e}")
            continue
        print(f"{name:26s} {statistics.median(t):6.2f} us [{min(t):.2f} - {max(t):.2f}]")


if __name__ == "__main__":
    main()
