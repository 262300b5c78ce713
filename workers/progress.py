"""Progress events from rank 0 to the driver, through a small async Ray actor.

Rank 0's `put` returns only once the driver has taken the event and asked for the next one,
so a driver callback sees the run at that step (the CLI prints it, the service stores it, a
test can kill a worker at a known point) and events are never dropped or reordered. The cost
is one round trip per logged step.
"""

from __future__ import annotations

import asyncio
from typing import Any

import ray


@ray.remote(num_cpus=0)
class ProgressRelay:
    def __init__(self) -> None:
        self._events: asyncio.Queue[tuple[dict[str, Any], asyncio.Event]] = asyncio.Queue()
        self._handed_out: asyncio.Event | None = None

    async def put(self, event: dict[str, Any]) -> None:
        """Called by rank 0; waits until the driver has handled `event`."""
        handled = asyncio.Event()
        await self._events.put((event, handled))
        await handled.wait()

    async def take(self) -> dict[str, Any]:
        """Called by the driver: marks the previous event handled and waits for the next."""
        if self._handed_out is not None:
            self._handed_out.set()
            self._handed_out = None
        event, self._handed_out = await self._events.get()
        return event
