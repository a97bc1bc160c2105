"""Fault tolerance on Ray: a stage's actor is killed in the middle of a 10,000-record
run; it restarts, unacknowledged records are replayed, and the sink still receives the
expected multiset exactly (no loss, no duplicates), with the restart in the stats. A
replica rebuilt after a crash must not wait for pushes its producer no longer holds
(acknowledged before the crash because a filter dropped their records)."""

import asyncio
import os
import threading
import time
from collections import Counter

import pytest

import tailrace as tr
from tailrace.runtime.ray import ActiveRuns
from tailrace.runtime.ray.instance import Stream

N = 10_000


def work(x):
    return x * 3 + 1


def post(x):
    return x % 7_919


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["work", "post"])  # fed by the driver / by an actor
def test_killing_a_stage_actor_mid_run_loses_and_duplicates_nothing(ray_session, victim):
    ray = ray_session
    got: list = []
    killed: list = []
    runs = ActiveRuns()

    def sink(x):
        got.append(x)
        if len(got) == 3_000 and not killed:  # well inside the run: ~7,000 still to come
            [run] = [r for r in runs.describe() if r["pipeline"] == "fault"]
            [(name, _node)] = run["stages"][victim]
            ray.kill(ray.get_actor(name), no_restart=False)
            killed.append(name)

    p = tr.Pipeline("fault")
    p.source(range(N)).map(work, id="work").map(post, id="post", queue=256).sink(sink)
    result = tr.run(p, runtime="ray", runs=runs)

    assert killed, "the stage actor was never killed"
    assert Counter(got) == Counter(post(work(x)) for x in range(N))
    assert not result.errors
    stats = result.stats
    assert stats.records_in == stats.records_out == N
    assert stats[victim].restarts >= 1  # the replica was rebuilt on the restarted actor
    assert stats.actor_restarts >= 1
    if victim == "work":  # post's actor lived: its counts are exact
        assert stats["post"].records_in >= N  # every record, plus the replayed ones
        assert stats.duplicates == stats["post"].records_out - N  # dropped by the sink


def _double(x):
    return 2 * x


def _keep(x):
    return x % 4 != 0


def _keep_some(x):
    return [x] if x % 4 != 0 else []


class Hold:
    """map: holds every record until the file ``release`` exists (at most 60 s)."""

    def __init__(self, release: str) -> None:
        self.release = release

    def __call__(self, x):
        deadline = time.monotonic() + 60
        while not os.path.exists(self.release) and time.monotonic() < deadline:
            time.sleep(0.01)
        return x


@pytest.mark.slow
@pytest.mark.parametrize("drop, fuse", [("filter", True), ("filter", False),
                                        ("flat_map", True)])
def test_a_replica_rebuilt_after_a_crash_does_not_wait_for_pushes_acknowledged_before(
        ray_session, tmp_path, drop, fuse):
    """One record per push into ``double`` (queue 6: a window of 6 pushes). A push whose
    record is dropped (0, 4, 8, ...) is acknowledged at once; one whose record is kept
    waits for ``hold``. Once the 11th push took its credit, pushes 1, 3, 5, 7, 9 are held
    and 0, 2, 4, 6, 8 acknowledged; ``double``'s actor is killed then. Its rebuilt replica
    got 1, 3, ... again and waited for push 2 forever (the run hung, 3 runs of 3)."""
    ray = ray_session
    release = tmp_path / "release"
    read_all = threading.Event()

    def source():
        yield from range(11)
        read_all.set()  # asked for more: push 10 took its credit, so 5 are in flight

    got: list = []
    name = f"gap-{drop}-{fuse}"
    p = tr.Pipeline(name)
    s = p.source(source()).map(_double, id="double", queue=6)
    s = s.filter(_keep, id="drop") if drop == "filter" else s.flat_map(_keep_some, id="drop")
    s.map(Hold(str(release)), id="hold", queue=64, blocking=True).sink(got)
    box: dict = {}
    runs = ActiveRuns()
    job = threading.Thread(
        target=lambda: box.setdefault("r", tr.run(p, runtime="ray", fuse=fuse, runs=runs)),
        daemon=True)
    job.start()
    try:
        assert read_all.wait(60), "the source never got to its end"
        [run] = [r for r in runs.describe() if r["pipeline"] == name]
        [(actor, _node)] = run["stages"]["double"]
        ray.kill(ray.get_actor(actor), no_restart=False)
    finally:
        release.touch()
    job.join(60)
    assert not job.is_alive(), f"the run hung; outputs so far: {sorted(got)}"
    assert sorted(got) == [2, 6, 10, 14, 18]
    result = box["r"]
    assert not result.errors
    assert result.stats["double"].restarts >= 1


def test_stream_orders_pushes_and_skips_the_ones_that_will_never_come():
    """``Stream`` alone: pushes enter after the one they name, whatever order they
    arrive in; a rebuilt replica's stream skips seqs acknowledged before it existed."""

    async def scenario(stream: Stream, arrivals: list[tuple[int, int, int]],
                       lows: dict[int, int] | None = None) -> list[int]:
        entered: list[int] = []

        async def push(seq: int, prev: int, low: int) -> None:
            stream.forget_below(low)
            if not stream.entered(prev):
                await stream.turn(prev)
            entered.append(seq)
            stream.enter(seq)

        tasks = []
        for seq, prev, low in arrivals:
            tasks.append(asyncio.ensure_future(push(seq, prev, low)))
            await asyncio.sleep(0)  # let it run up to its wait
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        return entered

    # first instance: 0..3 arrive as 2, 0, 3, 1 and enter in order
    assert asyncio.run(scenario(Stream(0), [(2, 1, 0), (0, -1, 0), (3, 2, 0),
                                            (1, 0, 0)])) == [0, 1, 2, 3]
    # rebuilt replica: 2, 4, 6 were acknowledged before the crash; 1, 3, 5, 7 come again,
    # 5 first, then a new push 8
    assert asyncio.run(scenario(Stream(1), [(5, 3, 1), (7, 5, 1), (3, 1, 1), (1, -1, 1),
                                            (8, 7, 1)])) == [1, 3, 5, 7, 8]
    # a push waiting for one acknowledged meanwhile is let in by a later push's low
    stream = Stream(1)

    async def late() -> list[int]:
        waiting = asyncio.ensure_future(scenario(stream, [(3, 2, 1)]))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        more = await scenario(stream, [(4, 3, 3)])
        return await waiting + more

    assert asyncio.run(late()) == [3, 4]
    assert stream.low == 5 and not stream.above and not stream.waiting
