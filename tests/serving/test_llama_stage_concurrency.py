"""A served ``generate`` stage over a continuously batching engine (llama.cpp) must not
hold a request behind the ones it is already generating: the engine merges requests as
they come (and ranks them by class), but only those the stage has handed it.

Issue 24 (found by ``bench/vs_llama_server.py``'s mixed workload): the stage used to call
the engine once per micro-batch and wait for the whole call, so a request arriving
meanwhile waited for the longest generation in it (interactive TTFT p50 29.6 s against
llama-server's 5.6 s). Now each record of such a stage is its own engine call, several in
flight (``Execution.in_flight``). The test asserts the order of completion, not a
time.
"""

from __future__ import annotations

import asyncio

import pytest

import tailrace as tr
from tailrace.serving import PipelineService

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def test_a_short_request_is_not_held_behind_a_long_generation():
    p = tr.Pipeline("hol", engines={"llm": {"backend": "llama_cpp",
                                            "model": "smollm2-135m-instruct",
                                            "n_threads": 2, "n_seq_max": 4}})
    (p.source(fields=["q"])
     .apply("generate", id="answer", engine="llm", input="q", output="a", max_tokens=256)
     .sink())

    async def main():
        svc = PipelineService(p)
        svc.start(asyncio.get_running_loop())
        while not svc.ready:
            assert svc.failure is None, svc.failure
            await asyncio.sleep(0.05)
        await svc.submit({"q": "hi"})  # warm
        long = asyncio.ensure_future(svc.submit(
            {"q": "Write a very long story about a river and a stone."}))
        while svc.stats()["answer"].records_in < 2:  # the long one is in the engine
            await asyncio.sleep(0.01)
        short = asyncio.ensure_future(svc.submit({"q": "Say yes."}))
        done, _ = await asyncio.wait({long, short}, return_when=asyncio.FIRST_COMPLETED)
        first = "short" if short in done else "long"
        await asyncio.gather(long, short)
        await svc.aclose()
        return first, len(long.result()["a"]), len(short.result()["a"])

    first, n_long, n_short = asyncio.run(main())
    assert n_short < n_long  # the premise: the short answer really is shorter
    assert first == "short"
