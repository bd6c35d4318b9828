"""``disconnect.Drain``: the grace period's arithmetic and ``race``, with a counter for
in-flight work (the engine's and the gateway's servers use it the same way)."""

from __future__ import annotations

import asyncio

from dsv4_serving.http.disconnect import Drain


def test_a_drain_waits_for_in_flight_work_and_returns_none_left() -> None:
    async def test() -> None:
        drain = Drain(poll_s=0.01)
        drain.held = 2

        async def finish() -> None:
            await asyncio.sleep(0.05)
            drain.held -= 2

        task = asyncio.create_task(finish())
        assert await drain.run(timeout_s=5.0) == 0
        await task
        assert drain.draining and not drain.expired.is_set()

    asyncio.run(test())


def test_past_the_grace_period_what_is_left_is_stopped() -> None:
    async def test() -> None:
        drain = Drain(poll_s=0.01)
        drain.held = 1

        async def forever() -> str:
            try:
                await asyncio.sleep(3600)
                return "done"
            finally:
                drain.held -= 1

        work = asyncio.create_task(drain.race(forever()))
        await asyncio.sleep(0)
        loop = asyncio.get_running_loop()
        t = loop.time()
        assert await drain.run(timeout_s=0.1, wind_down_s=1.0) == 1
        assert 0.1 <= loop.time() - t < 1.0  # the wind-down ended as soon as it was stopped
        assert await work is None and drain.held == 0 and drain.expired.is_set()

    asyncio.run(test())


def test_race_returns_the_result_of_work_that_finishes() -> None:
    async def test() -> None:
        drain = Drain()

        async def quick() -> int:
            return 7

        assert await drain.race(quick()) == 7
        assert await Drain(lambda: 3).run(timeout_s=0.0, wind_down_s=0.0) == 3

    asyncio.run(test())
