"""Request limits: bodies over a byte limit (413), and clients that keep failing to
authenticate (429)."""

from __future__ import annotations

import json
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send)
            return
        # Without a trustworthy length (chunked uploads), read up to the limit before the app
        # sees anything, then replay what was read.
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._refuse(send)
                return
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send) -> None:
        detail = json.dumps({"detail": f"request body exceeds {self.max_bytes} bytes"}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(detail)).encode())]})
        await send({"type": "http.response.body", "body": detail})


class FailedAuthLimiter:
    """At most `max_failures` failed authentications per client address in any `window_s`:
    past that, the client's requests answer 429 with Retry-After until its oldest failure in
    the window is `window_s` old, without their token being looked at (500 guesses in 30 s
    all answered 401 in 4 ms each). Failures are counted per API process; the `max_clients`
    addresses seen last are kept, so a flood from many addresses cannot grow it without bound."""

    def __init__(self, max_failures: int, window_s: float, *, max_clients: int = 10_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_failures, self.window_s, self.max_clients = max_failures, window_s, max_clients
        self._clock = clock
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()
        self._lock = threading.Lock()  # the auth dependency runs in the thread pool

    def retry_after_s(self, client: str) -> int | None:
        """Seconds until `client` may try again, or None if it may now."""
        with self._lock:
            failures = self._recent(client)
            if failures is None or len(failures) < self.max_failures:
                return None
            return max(1, math.ceil(failures[0] + self.window_s - self._clock()))

    def failed(self, client: str) -> None:
        with self._lock:
            failures = self._recent(client)
            if failures is None:
                failures = self._failures[client] = deque()
                while len(self._failures) > self.max_clients:
                    self._failures.popitem(last=False)
            failures.append(self._clock())
            self._failures.move_to_end(client)

    def _recent(self, client: str) -> deque[float] | None:
        failures = self._failures.get(client)
        if failures is None:
            return None
        while failures and failures[0] <= self._clock() - self.window_s:
            failures.popleft()
        return failures
