"""The data frames of one receiving connection whose bodies are still landing, on a link whose
bodies travel apart from the frame stream (ucx: a header over TCP, its body a UCX tag message).

The receiver admits such a frame and posts its body's receive, then reads the next header
instead of waiting for the body, so the sender's next body can move while this one lands (a
large UCX message moves only once its receive is posted). Each frame is then handled by a task
of its own, chained to the one before (``Landing.add``): it lands and is verified and counted
on its own, but is acknowledged only after every earlier frame was handled, because an ACK
covers every frame up to its sequence number::

    frame stream   H1      H2      H3      SYNC
    bodies         [== 1 ==][== 2 ==][== 3 ==]        (posted as each header is admitted)
    acks                   A1       A2       A3  SYNCED   (in order; SYNC waits, ``settle``)

Any other frame (END, SYNC, ABORT, a body on the stream) waits until the chain is settled,
so "every earlier frame of the connection is handled" still holds when it is handled. The
first frame whose handling fails ends the link: the chain closes it, which wakes the reader
(its next frame is the ``LinkClosed``), and ``settle`` raises that failure, with the frame's
header in ``failed_header``. Runs on the I/O loop only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from kvstore.transfer.base import RecvLink
from kvstore.transfer.frames import FrameHeader

# What handles one frame, given what it must wait for before its ACK (None: nothing is ahead).
Handler = Callable[[Awaitable[None] | None], Coroutine[Any, Any, None]]


class Landing:
    """One connection's chain of frames being handled (see the module docstring)."""

    def __init__(self, link: RecvLink):
        self._link = link
        self._tail: asyncio.Future[None] | None = None
        self._pending: set[asyncio.Future[None]] = set()
        self._failure: Exception | None = None
        self.failed_header: FrameHeader | None = None  # the frame of the first failure

    def add(self, header: FrameHeader, handle: Handler) -> None:
        """Start handling a frame: ``handle(before)`` awaits ``before`` (the frame ahead of it,
        handled or failed) before acknowledging its own."""
        task = asyncio.ensure_future(self._run(header, handle, self._tail))
        task.add_done_callback(self._done)
        self._pending.add(task)
        self._tail = task

    async def _run(self, header: FrameHeader, handle: Handler, before: asyncio.Future[None] | None) -> None:
        try:
            await handle(before)
        except Exception as exc:
            if self._failure is None:
                self._failure, self.failed_header = exc, header
                self._link.close()  # the reader's next frame is the LinkClosed
            raise

    @property
    def idle(self) -> bool:
        """Nothing added is still being handled, and nothing failed (``settle`` would return
        at once: the reader skips it, as on links whose bodies ride the stream)."""
        return not self._pending and self._failure is None

    async def settle(self) -> None:
        """Wait until every frame added so far is handled; raises the first failure if one
        failed (its frame: ``failed_header``)."""
        self._tail = None
        if self._pending:  # a frame that failed early may end before the ones ahead of it
            await asyncio.wait(set(self._pending))
        if self._failure is not None:
            raise self._failure

    def _done(self, task: asyncio.Future[None]) -> None:
        self._pending.discard(task)
        if not task.cancelled():
            task.exception()  # seen: the chain reports the first failure (``settle``)
