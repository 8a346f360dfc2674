"""Weighted fair admission: at most ``max_running`` requests in the cluster and ``max_queued``
waiting, shared among tenants by the limits and weights of their API keys.

A tenant's ``TenantLimits`` (``conductor.apikeys``: ``max_running``, ``max_queued``,
``weight``; an unset limit is the cluster's, the weight 1) decide, in this order:

- a free running slot goes to a waiting request of the tenant with the fewest running
  requests per weight (``running / weight``), oldest first within a tenant, and never to a
  tenant already at its ``max_running``: a tenant at its limit waits even while slots are free;
- a request that would have to wait while its tenant already has ``max_queued`` waiting is
  refused at once (``tenant_limit``, naming the tenant's limits);
- when the cluster's queue is full, a newcomer whose tenant holds less of the queue per
  weight than another tenant takes the place of that tenant's newest waiting request, which
  is refused (``tenant_share``); otherwise the newcomer is refused (``queue_full``);
- a waiting request whose caller says it is ``gone`` (its client left) gives its place up at
  once (``gone``): it is never granted a slot nobody would use;
- a waiting request waits at most the timeout its caller gives (``waited``). The Conductor
  gives the sooner of the request's deadline (``deadline_s``, or the client's gRPC deadline)
  and ``--max-queue-wait-s``, and answers DEADLINE_EXCEEDED when the deadline was the bound,
  RESOURCE_EXHAUSTED otherwise (every other refusal is RESOURCE_EXHAUSTED too).

So a tenant over its share is refused first while others are admitted; with no limits and
one tenant this is plain bounded FIFO admission. Thread-safe: one lock; slots are granted by
the thread that frees one or arrives, and a waiter only watches its own ticket.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field

REFUSAL_KINDS = ("queue_full", "tenant_limit", "tenant_share", "waited", "gone")


@dataclass(frozen=True)
class AdmissionConfig:
    max_running: int = 16
    max_queued: int = 64

    def __post_init__(self) -> None:
        if self.max_running < 1 or self.max_queued < 0:
            raise ValueError(f"max_running {self.max_running} must be >= 1 and max_queued {self.max_queued} >= 0")


@dataclass(frozen=True)
class TenantLimits:
    """One tenant's share: ``None`` limits are the cluster's; ``weight`` orders contended slots."""

    max_running: int | None = None
    max_queued: int | None = None
    weight: float = 1.0

    def __post_init__(self) -> None:
        if self.max_running is not None and self.max_running < 1:
            raise ValueError(f"max_running {self.max_running} must be >= 1")
        if self.max_queued is not None and self.max_queued < 0:
            raise ValueError(f"max_queued {self.max_queued} must be >= 0")
        if not self.weight > 0:
            raise ValueError(f"weight {self.weight} must be > 0")


@dataclass(frozen=True)
class Refusal:
    """Why a request was not admitted: ``kind`` is one of ``REFUSAL_KINDS``."""

    kind: str
    message: str

    def __str__(self) -> str:
        return self.message


@dataclass(eq=False)
class _Ticket:
    tenant: str
    seq: int
    granted: bool = False
    refusal: Refusal | None = None


@dataclass(eq=False)
class _Tenant:
    limits: TenantLimits
    num_running: int = 0
    waiting: deque[_Ticket] = field(default_factory=deque)


class Admission:
    def __init__(self, config: AdmissionConfig):
        self.config = config
        self._cond = threading.Condition()
        self._tenants: dict[str, _Tenant] = {}
        self._seq = itertools.count()
        self.num_running = 0  # read by the metrics without the lock (a snapshot is good enough)
        self.num_queued = 0

    def try_enter(self, timeout_s: float, tenant: str = "", limits: TenantLimits = TenantLimits(),
                  gone: threading.Event | None = None) -> Refusal | None:
        """None when admitted (the caller must ``leave(tenant)`` later); else why not. Blocks
        up to ``timeout_s`` while queued, or until ``gone`` is set (then ``wake``).
        ``limits``: the tenant's, as its key says now."""
        with self._cond:
            t = self._tenants.setdefault(tenant, _Tenant(limits))
            t.limits = limits
            ticket = _Ticket(tenant, next(self._seq))
            t.waiting.append(ticket)
            self.num_queued += 1
            self._grant()
            if ticket.granted:
                return None
            refusal = self._refuse_to_queue(tenant, t)
            if refusal is not None:
                self._withdraw(t, ticket)
                return refusal
            until = time.monotonic() + timeout_s
            while not ticket.granted and ticket.refusal is None:
                if gone is not None and gone.is_set():
                    self._withdraw(t, ticket)
                    return Refusal("gone", "the client left while the request waited in the admission queue")
                left = until - time.monotonic()
                if left <= 0:
                    self._withdraw(t, ticket)
                    return Refusal("waited", f"waited {timeout_s:.1f}s in the admission queue without a free slot")
                self._cond.wait(left)
            self._forget_if_idle(tenant, t)  # a ticket refused to make room left its tenant perhaps idle
            return ticket.refusal

    def leave(self, tenant: str = "") -> None:
        with self._cond:
            t = self._tenants.get(tenant)
            assert t is not None and t.num_running > 0 and self.num_running > 0, "leave without enter"
            t.num_running -= 1
            self.num_running -= 1
            self._grant()
            self._forget_if_idle(tenant, t)

    def wake(self) -> None:
        """Every waiter looks at its ``gone`` again (a caller sets one, then wakes them)."""
        with self._cond:
            self._cond.notify_all()

    def running_of(self, tenant: str) -> tuple[int, int]:
        """(running, waiting) requests of ``tenant`` now."""
        with self._cond:
            t = self._tenants.get(tenant)
            return (t.num_running, len(t.waiting)) if t is not None else (0, 0)

    # ---- under the lock ------------------------------------------------------------------------
    def _max_running(self, t: _Tenant) -> int:
        return min(self.config.max_running, t.limits.max_running or self.config.max_running)

    def _grant(self) -> None:
        """Free slots to the waiting requests of the tenants with the fewest running per weight."""
        granted = False
        while self.num_running < self.config.max_running:
            eligible = [t for t in self._tenants.values() if t.waiting and t.num_running < self._max_running(t)]
            if not eligible:
                break
            best = min(eligible, key=lambda t: (t.num_running / t.limits.weight, t.waiting[0].seq))
            best.waiting.popleft().granted = True
            best.num_running += 1
            self.num_running += 1
            self.num_queued -= 1
            granted = True
        if granted:
            self._cond.notify_all()

    def _refuse_to_queue(self, tenant: str, t: _Tenant) -> Refusal | None:
        """Why the newest request of ``t`` (not granted) may not wait, or None; may evict another
        tenant's newest waiting request to make room for it."""
        cfg, own_queued, max_queued = self.config, len(t.waiting), t.limits.max_queued
        if max_queued is not None and own_queued > max_queued:
            return Refusal("tenant_limit", f"tenant {tenant!r} is at its limits: {t.num_running} running (limit "
                                           f"max_running {self._max_running(t)}), {own_queued - 1} queued (limit "
                                           f"max_queued {max_queued})")
        if self.num_queued <= cfg.max_queued:
            return None
        others = [u for u in self._tenants.values() if u is not t and u.waiting]
        over = max(others, key=lambda u: (len(u.waiting) / u.limits.weight, u.waiting[-1].seq), default=None)
        if over is None or len(over.waiting) / over.limits.weight <= own_queued / t.limits.weight:
            return Refusal("queue_full", f"admission queue full: {self.num_running} running (limit "
                                         f"{cfg.max_running}), {self.num_queued - 1} queued (limit {cfg.max_queued})")
        victim = over.waiting.pop()
        self.num_queued -= 1
        victim.refusal = Refusal("tenant_share", (
            f"tenant {victim.tenant!r} is over its share of the admission queue ({len(over.waiting) + 1} queued, "
            f"weight {over.limits.weight:g}, queue limit {cfg.max_queued}): its newest waiting request gave its "
            f"place to a tenant under its share"))
        self._cond.notify_all()
        return None

    def _withdraw(self, t: _Tenant, ticket: _Ticket) -> None:
        t.waiting.remove(ticket)
        self.num_queued -= 1
        self._forget_if_idle(ticket.tenant, t)

    def _forget_if_idle(self, tenant: str, t: _Tenant) -> None:
        if t.num_running == 0 and not t.waiting and self._tenants.get(tenant) is t:
            del self._tenants[tenant]
