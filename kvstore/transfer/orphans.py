"""UCX operations a link gave up on (``Orphans``): ucxx has no per-request cancel, and a posted
request keeps using its buffer, which its task keeps alive, so such tasks are never cancelled,
only parked (``_parked`` holds every link's) until UCX completes or fails them. Every
exception is retrieved, so asyncio never reports one as never retrieved, and each link's batch
is logged once, in one line. No ucxx import: plain asyncio futures. I/O loop only.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Iterable

logger = logging.getLogger("kvstore.transfer.ucx")
_parked: set[asyncio.Future] = set()  # every link's abandoned operations, alive until they end


def num_parked() -> int:
    """Abandoned operations of every link that have not ended yet."""
    return len(_parked)


class Orphans:
    """UCX operations one link gave up on (peer gone, link closed, no progress). ucxx has no
    per-request cancel, and a posted request keeps using its buffer, which its task keeps
    alive: so such tasks are never cancelled, only parked here (the module's ``_parked``
    holds them) until UCX completes or fails them, typically with
    ``UCXXConnectionResetError`` or ``UCXXError('Endpoint timeout')`` once the endpoint is
    aborted. Every exception is retrieved, so none is reported as never retrieved; the link's
    whole batch is logged once, in one line, when the link is closed (``seal``) and its last
    parked operation has ended. I/O loop only."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._pending = 0
        self._sealed = False
        self._outcomes: collections.Counter[str] = collections.Counter()

    def park(self, tasks: Iterable[asyncio.Future]) -> None:
        for task in tasks:
            if _ended(task):
                continue
            self._pending += 1
            _parked.add(task)
            task.add_done_callback(self._collect)

    def seal(self) -> None:
        """The link is closed: log the batch once its operations have ended."""
        self._sealed = True
        self._maybe_log()

    def _collect(self, task: asyncio.Future) -> None:
        _parked.discard(task)
        self._pending -= 1
        self._outcomes[_outcome(task)] += 1
        self._maybe_log()

    def _maybe_log(self) -> None:
        if self._sealed and not self._pending and self._outcomes:
            outcomes, self._outcomes = self._outcomes, collections.Counter()
            logger.info("%s: %d abandoned UCX operation(s) ended: %s", self.what, sum(outcomes.values()),
                        ", ".join(f"{n} {outcome}" for outcome, n in sorted(outcomes.items())))


def _ended(task: asyncio.Future) -> bool:
    """True for a task that is done (its exception, if any, now retrieved)."""
    if not task.done():
        return False
    _outcome(task)
    return True


def _outcome(task: asyncio.Future) -> str:
    if task.cancelled():
        return "cancelled"
    exc = task.exception()  # retrieved: asyncio will not report it as never retrieved
    return "completed" if exc is None else f"failed with {exc!r}"

