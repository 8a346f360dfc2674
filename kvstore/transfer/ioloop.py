"""The transfer engine's I/O thread: one uvloop event loop in one daemon thread.

Senders and receivers run all socket, shm-ring and UCX work on it, so the caller's thread
(a prefill loop running torch compute) only enqueues and waits. Coroutines submitted here must
not block for long; checksums and body copies release the GIL on large buffers. One process-
wide instance (``IoThread.shared()``) is enough; tests may create private ones.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import uvloop

logger = logging.getLogger(__name__)
T = TypeVar("T")

_shared_lock = threading.Lock()
_shared: IoThread | None = None


class IoThread:
    """A running event loop in a background thread. Thread-safe entry points only."""

    def __init__(self, name: str = "tidekv-transfer-io"):
        self.loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        # A daemon thread still inside the loop when the interpreter finalizes crashes the
        # process (a uv timer fires and asks for the GIL of a dead interpreter): stop it first.
        atexit.register(self.stop)

    @classmethod
    def shared(cls) -> IoThread:
        """The process-wide I/O thread, started on first use."""
        global _shared
        with _shared_lock:
            if _shared is None or not _shared._thread.is_alive():
                _shared = cls()
            return _shared

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def in_thread(self) -> bool:
        return threading.get_ident() == self._thread.ident

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result from a non-loop thread."""
        if self.in_thread():
            coro.close()
            raise RuntimeError("IoThread.run called from the I/O thread itself; that would deadlock")
        future = self.submit(coro)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the loop (pending tasks are abandoned) and join the thread."""
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("transfer I/O thread did not stop within %.1f s", timeout_s)
