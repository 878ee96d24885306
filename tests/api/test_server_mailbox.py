"""Engine-thread events reach their streams in order, with one loop wake-up per burst (api/generation.Mailbox)."""

from __future__ import annotations

import asyncio
import threading

from k3verify.api.generation import Mailbox
from k3verify.serving.events import EngineEvent


def test_a_burst_from_another_thread_arrives_in_order_with_few_wakeups() -> None:
    async def main() -> tuple[list[list[int]], int]:
        loop = asyncio.get_running_loop()
        box = Mailbox(loop)
        wakeups = 0
        stock = loop.call_soon_threadsafe

        def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            nonlocal wakeups
            wakeups += 1
            return stock(*args, **kwargs)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        queues: list[asyncio.Queue[EngineEvent]] = [asyncio.Queue() for _ in range(4)]
        burst = threading.Thread(target=lambda: [box.post(queues[i % 4], EngineEvent(token_ids=[i]))
                                                 for i in range(400)])
        burst.start()
        got: list[list[int]] = [[] for _ in queues]
        for q, out in zip(queues, got, strict=True):
            for _ in range(100):
                out.append((await asyncio.wait_for(q.get(), 5)).token_ids[0])
        burst.join()
        return got, wakeups

    got, wakeups = asyncio.run(main())
    assert got == [list(range(i, 400, 4)) for i in range(4)]
    assert 1 <= wakeups < 400, wakeups
