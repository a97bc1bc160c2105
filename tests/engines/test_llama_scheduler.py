"""The llama.cpp engine's scheduler and prefix cache with no model: which requests start,
pause and resume, which prompt chunks go into a step, which KV stream a prompt gets."""

from __future__ import annotations

import math

import numpy as np

from tailrace.engines.base import GenerationRequest
from tailrace.engines.call import Call
from tailrace.engines.llama_cpp.prefix_cache import PrefixCache
from tailrace.engines.llama_cpp.scheduler import Job, Scheduler, Seq, State


def job(name: str, priority: int = 0, deadline: float | None = None, prompt: int = 10,
        call: Call | None = None) -> Job:
    req = GenerationRequest(prompt=name, priority=priority, deadline=deadline)
    return Job(call or Call(1), 0, req, np.arange(prompt, dtype=np.int32))


class Streams:
    """``start`` for the scheduler: each job gets the lowest free stream (or none if its
    call failed); ``done`` finishes a sequence and frees its stream."""

    def __init__(self) -> None:
        self.free = list(range(256))
        self.started: list[str] = []

    def start(self, j: Job) -> Seq | None:
        if j.call.failed:
            return None
        self.started.append(j.request.prompt)
        self.free.sort()
        return Seq(j, self.free.pop(0))

    def done(self, sched: Scheduler, s: Seq) -> None:
        s.state = State.DONE
        self.free.append(s.slot)
        sched.retire()


def names(seqs: list[Seq]) -> list[str]:
    return [s.job.request.prompt for s in seqs]


def run_to_end(sched: Scheduler, streams: Streams) -> None:
    """Finish whatever is active, one at a time in slot order, until nothing is left."""
    sched.schedule(streams.start)
    while sched.active:
        streams.done(sched, sched.active[0])
        sched.schedule(streams.start)


def test_waiting_jobs_start_by_class_then_deadline_then_arrival():
    sched, streams = Scheduler(n_active=1, n_streams=1, chunk=4, n_batch=64), Streams()
    for j in [job("a"), job("b", deadline=50.0), job("c", priority=1), job("d", deadline=10.0),
              job("e", priority=1, deadline=5.0), job("f")]:
        sched.add(j)
    run_to_end(sched, streams)
    assert streams.started == ["e", "c", "d", "b", "a", "f"]
    assert sched.idle() and sched.preemptions == 0


def test_free_slots_fill_at_once_and_active_is_kept_in_slot_order():
    sched, streams = Scheduler(n_active=3, n_streams=3, chunk=4, n_batch=64), Streams()
    for j in [job("low"), job("mid", priority=1), job("high", priority=2), job("later")]:
        sched.add(j)
    sched.schedule(streams.start)
    assert streams.started == ["high", "mid", "low"] and sched.waiting == 1
    assert [s.slot for s in sched.active] == [0, 1, 2]  # llama.cpp's ubatch order
    streams.done(sched, sched.active[1])  # slot 1 frees
    sched.schedule(streams.start)
    assert [s.slot for s in sched.active] == [0, 1, 2] and names(sched.active)[1] == "later"


def test_a_more_urgent_job_preempts_the_least_urgent_sequence_which_resumes_first():
    sched, streams = Scheduler(n_active=2, n_streams=3, chunk=4, n_batch=64), Streams()
    sched.add(job("low", deadline=20.0))
    sched.add(job("lower", deadline=30.0))
    sched.schedule(streams.start)
    lower = sched.active[1]
    lower.feed(lower.n_prompt)
    assert lower.state is State.DECODING
    sched.add(job("also-low", deadline=40.0))  # same class: waits, preempts nobody
    sched.add(job("urgent", priority=2))
    sched.schedule(streams.start)
    assert sched.preemptions == 1 and sched.paused == [lower]
    assert lower.state is State.PAUSED
    assert names(sched.active) == ["low", "urgent"]
    streams.done(sched, sched.active[1])  # urgent ends: the paused one comes back first
    sched.schedule(streams.start)
    assert names(sched.active) == ["low", "lower"] and not sched.paused
    assert lower.state is State.DECODING and lower.slot == 1  # where it stopped, its stream
    run_to_end(sched, streams)
    assert streams.started == ["low", "lower", "urgent", "also-low"]
    assert sched.preemptions == 1


def test_a_paused_sequence_resumes_before_later_jobs_of_its_own_class():
    sched, streams = Scheduler(n_active=1, n_streams=2, chunk=4, n_batch=64), Streams()
    sched.add(job("first"))
    sched.schedule(streams.start)
    sched.add(job("second"))  # arrived after "first": ranks after it
    sched.add(job("urgent", priority=1))
    sched.schedule(streams.start)
    assert names(sched.active) == ["urgent"] and names(sched.paused) == ["first"]
    streams.done(sched, sched.active[0])
    sched.schedule(streams.start)
    assert names(sched.active) == ["first"] and sched.waiting == 1


def test_preemption_needs_a_spare_stream_and_a_strictly_more_urgent_job():
    sched, streams = Scheduler(n_active=1, n_streams=1, chunk=4, n_batch=64), Streams()
    sched.add(job("low"))
    sched.schedule(streams.start)
    sched.add(job("urgent", priority=5))
    sched.schedule(streams.start)  # no spare stream: the urgent one waits its turn
    assert names(sched.active) == ["low"] and sched.preemptions == 0
    spare, streams2 = Scheduler(n_active=1, n_streams=2, chunk=4, n_batch=64), Streams()
    spare.add(job("low", deadline=1.0))
    spare.schedule(streams2.start)
    spare.add(job("same-class", deadline=0.5))  # earlier deadline, same class: no preemption
    spare.schedule(streams2.start)
    assert names(spare.active) == ["low"] and spare.preemptions == 0


def test_preemption_stops_when_no_stream_is_spare():
    sched, streams = Scheduler(n_active=2, n_streams=3, chunk=4, n_batch=64), Streams()
    sched.add(job("a"))
    sched.add(job("b", deadline=1.0))
    sched.schedule(streams.start)
    sched.add(job("u1", priority=1))
    sched.add(job("u2", priority=1))
    sched.schedule(streams.start)
    # one spare stream: one victim (the least urgent, "a": no deadline), one urgent starts
    assert sched.preemptions == 1 and names(sched.paused) == ["a"]
    assert sorted(names(sched.active)) == ["b", "u1"] and sched.waiting == 1
    sched.schedule(streams.start)  # every stream is held now: u2 waits, nobody pauses
    assert sched.preemptions == 1 and sched.waiting == 1


def test_a_job_whose_call_failed_is_dropped_and_the_next_one_starts():
    sched, streams = Scheduler(n_active=1, n_streams=1, chunk=4, n_batch=64), Streams()
    gone = Call(1)
    gone.fail(RuntimeError("caller went away"))
    sched.add(job("gone", priority=1, call=gone))
    sched.add(job("next"))
    sched.schedule(streams.start)
    assert names(sched.active) == ["next"] and sched.waiting == 0


def test_only_the_most_urgent_class_is_prefilled_within_the_budget():
    sched, streams = Scheduler(n_active=4, n_streams=4, chunk=8, n_batch=20), Streams()
    sched.add(job("urgent-long", priority=2, prompt=30))
    sched.add(job("urgent-short", priority=2, prompt=5, deadline=1.0))
    sched.add(job("low", prompt=30))
    sched.add(job("decoding", priority=1, prompt=3))
    sched.schedule(streams.start)
    by = {s.job.request.prompt: s for s in sched.active}
    by["decoding"].feed(3)
    allot = sched.prefill()
    # budget 20 - 1 decoding token; urgent-short (deadline) first: 5, then a chunk of 8
    assert {names([s])[0]: c for s, c in allot.items()} == {"urgent-short": 5,
                                                             "urgent-long": 8}
    for s, c in allot.items():
        s.feed(c)
    assert by["urgent-short"].state is State.DECODING
    allot = sched.prefill()
    assert {names([s])[0]: c for s, c in allot.items()} == {"urgent-long": 8}
    # the urgent class ends; while the class-1 sequence only decodes, the low prompt
    # gets one background chunk a step (no more: the decoding tokens wait for it)
    for name in ("urgent-long", "urgent-short"):
        streams.done(sched, by[name])
    assert {names([s])[0]: c for s, c in sched.prefill().items()} == {"low": 8}
    streams.done(sched, by["decoding"])
    assert {names([s])[0]: c for s, c in sched.prefill().items()} == {"low": 8}


def test_a_less_urgent_prompt_waits_while_a_more_urgent_one_is_prefilled():
    """Background chunks go in only while the urgent class decodes; one a step."""
    sched, streams = Scheduler(n_active=4, n_streams=4, chunk=8, n_batch=64), Streams()
    sched.add(job("urgent", priority=2, prompt=20))
    sched.add(job("low-a", prompt=30))
    sched.add(job("low-b", prompt=30))
    sched.schedule(streams.start)
    by = {s.job.request.prompt: s for s in sched.active}
    assert {names([s])[0]: c for s, c in sched.prefill().items()} == {"urgent": 8}
    by["urgent"].feed(20)  # now it decodes
    assert {names([s])[0]: c for s, c in sched.prefill().items()} == {"low-a": 8}


def test_a_chunk_that_does_not_fit_is_skipped_for_smaller_ones():
    sched, streams = Scheduler(n_active=3, n_streams=3, chunk=8, n_batch=10), Streams()
    sched.add(job("a", prompt=20, deadline=1.0))
    sched.add(job("b", prompt=20, deadline=2.0))
    sched.add(job("c", prompt=2, deadline=3.0))
    sched.schedule(streams.start)
    assert {names([s])[0]: c for s, c in sched.prefill().items()} == {"a": 8, "c": 2}


def test_drain_hands_back_everything_after_a_failure():
    sched, streams = Scheduler(n_active=1, n_streams=2, chunk=4, n_batch=64), Streams()
    sched.add(job("a"))
    sched.schedule(streams.start)
    sched.add(job("b"))
    sched.add(job("u", priority=1))
    sched.schedule(streams.start)
    seqs, jobs = sched.drain()
    assert sorted(names(seqs)) == ["a", "u"] and [j.request.prompt for j in jobs] == ["b"]
    assert sched.idle()


def test_ranks_are_class_then_deadline_then_arrival():
    sched = Scheduler(n_active=1, n_streams=1, chunk=4, n_batch=64)
    a, b = job("a", priority=1), job("b", deadline=3.0)
    sched.add(a)
    sched.add(b)
    assert a.rank == (-1, math.inf, 0) and b.rank == (0, 3.0, 1) and a.rank < b.rank


# -- the prefix cache --------------------------------------------------------------------
class Memory:
    """A stand-in for ``llama_memory_seq_rm``: records the removals."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int]] = []

    def __call__(self, stream: int, p0: int, p1: int) -> bool:
        self.calls.append((stream, p0, p1))
        return True


def tokens(*parts: range) -> np.ndarray:
    return np.concatenate([np.arange(p.start, p.stop, dtype=np.int32) for p in parts])


def test_the_longest_whole_chunk_prefix_is_reused_and_the_rest_removed():
    mem = Memory()
    cache = PrefixCache(3, 4, mem)
    slot, hit = cache.take(tokens(range(10)))
    assert hit == 0 and mem.calls == [(slot, -1, -1)]
    cache.release(slot, tokens(range(10)), fed=10)  # keeps 8 tokens: two whole chunks
    assert len(cache.streams[slot]) == 8 and mem.calls[-1] == (slot, 8, -1)
    other, _ = cache.take(tokens(range(100, 110)))
    assert other != slot  # the stream holding a prefix is not the first choice
    cache.release(other, tokens(range(100, 110)), fed=10)
    again, hit = cache.take(tokens(range(6), range(50, 60)))  # shares 6 tokens: 1 chunk
    assert again == slot and hit == 4 and mem.calls[-1] == (slot, 4, -1)
    assert cache.statistics() == {"lookups": 3, "prompt_tokens": 36, "hit_tokens": 4,
                                  "hit_ratio": 4 / 36}


def test_the_last_prompt_token_is_always_computed():
    cache = PrefixCache(2, 4, Memory())
    prompt = tokens(range(8))
    slot, _ = cache.take(prompt)
    cache.release(slot, prompt, fed=8)
    assert cache.take(prompt) == (slot, 4)  # 7 reusable tokens: one whole chunk


def test_without_a_shared_prefix_the_least_recently_used_stream_is_taken():
    cache = PrefixCache(2, 4, Memory())
    a, _ = cache.take(tokens(range(8)))
    b, _ = cache.take(tokens(range(20, 28)))
    cache.release(b, tokens(range(20, 28)), fed=8)
    cache.release(a, tokens(range(8)), fed=8)
    assert cache.take(tokens(range(40, 48))) == (b, 0)  # b was released first
    assert cache.streams[b] is None and cache.busy == {b}


def test_a_disabled_cache_keeps_nothing():
    mem = Memory()
    cache = PrefixCache(1, 4, mem, enabled=False)
    slot, _ = cache.take(tokens(range(9)))
    cache.release(slot, tokens(range(9)), fed=9)
    assert cache.streams == [None] and mem.calls[-1] == (slot, -1, -1)
    assert cache.take(tokens(range(9))) == (slot, 0)
