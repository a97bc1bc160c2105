import asyncio

import pytest

from tailrace.runtime.local import Channel, collect_batch


def test_put_nowait_respects_the_bound():
    ch = Channel(4)
    assert ch.put_nowait([1, 2, 3], 0.0)
    assert not ch.put_nowait([4, 5], 0.0)  # would exceed the bound: producer must wait
    assert ch.put_nowait([4], 0.0)
    assert ch.depth == ch.max_depth == 4


def test_get_takes_up_to_max_n_and_coalesces():
    ch = Channel(10)
    ch.put_nowait([1], 1.0)
    ch.put_nowait([2, 3], 0.5)
    enq, born, recs = ch.get_nowait(10)
    assert recs == [1, 2, 3] and born == 0.5
    ch.put_nowait([4, 5, 6], 2.0)
    assert ch.get_nowait(2)[2] == [4, 5]
    assert ch.get_nowait(2)[2] == [6]
    assert ch.get_nowait(2) is None


def test_shared_lists_are_never_mutated():
    shared = [1, 2]
    ch = Channel(10)
    ch.put_nowait(shared, 0.0)
    ch.put_nowait([3], 0.0)
    ch.get_nowait(10)
    assert shared == [1, 2]


def test_zero_bound_is_rejected():
    with pytest.raises(ValueError, match="channel bound must be >= 1, got 0"):
        Channel(0)


def test_full_channel_blocks_producer_until_consumer_takes():
    async def main():
        ch = Channel(2)
        log = []

        async def producer():
            for i in range(6):
                await ch.put([i], 0.0)
                log.append(("put", i, ch.depth))
            ch.close()

        async def consumer():
            got = []
            while (item := await ch.get(1)) is not None:
                got += item[2]
                await asyncio.sleep(0)
            return got

        _, got = await asyncio.gather(producer(), consumer())
        assert got == list(range(6))
        assert ch.max_depth <= 2
        assert all(depth <= 2 for _, _, depth in log)

    asyncio.run(main())


def test_long_lists_are_split_to_the_bound():
    async def main():
        ch = Channel(3)
        task = asyncio.ensure_future(ch.put(list(range(7)), 0.0))
        got = []
        while len(got) < 7:
            item = await ch.get(100)
            assert len(item[2]) <= 3
            got += item[2]
        await task
        return got

    assert asyncio.run(main()) == list(range(7))


def test_close_ends_consumers_after_draining():
    async def main():
        ch = Channel(5, producers=2)
        ch.put_nowait([1], 0.0)
        ch.close()
        assert not ch.closed
        ch.close()
        assert ch.closed
        assert (await ch.get(5))[2] == [1]
        assert await ch.get(5) is None

    asyncio.run(main())


class VirtualClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_batch_window_fills_to_max_size_without_waiting():
    async def main():
        ch = Channel(10)
        ch.put_nowait([1, 2, 3], 0.0)
        ch.put_nowait([4, 5], 0.0)
        clock = VirtualClock()
        item = await collect_batch(ch, max_n=4, max_wait=60.0, clock=clock)
        return item[2]

    assert asyncio.run(main()) == [1, 2, 3, 4]


def test_batch_window_expired_deadline_returns_what_is_there():
    async def main():
        ch = Channel(10)
        ch.put_nowait([1], 0.0)

        class Jump(VirtualClock):
            calls = 0

            def __call__(self):
                self.calls += 1
                return 0.0 if self.calls == 1 else 100.0  # deadline passes at once

        item = await collect_batch(ch, max_n=4, max_wait=1.0, clock=Jump())
        return item[2]

    assert asyncio.run(main()) == [1]
