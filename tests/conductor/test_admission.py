"""Weighted fair admission (conductor/admission.py): exact grant order, limits and refusals at
tiny sizes. Waiting requests are threads; the test waits for the queue to reach a known state
before acting, and asserts order and kinds, never time."""

from __future__ import annotations

import threading
import time

import pytest

from conductor.admission import Admission, AdmissionConfig, Refusal, TenantLimits

NO_LIMITS = TenantLimits()


class Waiter:
    """One ``try_enter`` on its own thread; ``result`` once it returned."""

    def __init__(self, admission: Admission, tenant: str, limits: TenantLimits = NO_LIMITS,
                 timeout_s: float = 30.0):
        self.tenant = tenant
        self.done = threading.Event()
        self.gone = threading.Event()  # set (then ``admission.wake()``) when its client leaves
        self.result: Refusal | None = None
        self._thread = threading.Thread(target=self._run, args=(admission, tenant, limits, timeout_s), daemon=True)
        self._thread.start()

    def _run(self, admission, tenant, limits, timeout_s) -> None:
        self.result = admission.try_enter(timeout_s, tenant, limits, gone=self.gone)
        self.done.set()

    def outcome(self) -> Refusal | None:
        assert self.done.wait(10), f"{self.tenant}'s request is still waiting"
        return self.result


def until(predicate, what: str) -> None:
    deadline = time.monotonic() + 10
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def queued(admission: Admission, n: int) -> None:
    until(lambda: admission.num_queued == n, f"expected {n} queued, have {admission.num_queued}")


def test_one_tenant_is_bounded_fifo():
    adm = Admission(AdmissionConfig(max_running=2, max_queued=1))
    assert adm.try_enter(1.0) is None and adm.try_enter(1.0) is None
    third = Waiter(adm, "")
    queued(adm, 1)
    full = adm.try_enter(1.0)
    assert full.kind == "queue_full" and "2 running (limit 2), 1 queued (limit 1)" in full.message
    adm.leave()
    assert third.outcome() is None and (adm.num_running, adm.num_queued) == (2, 0)
    waited = adm.try_enter(0.05)
    assert waited.kind == "waited" and adm.num_queued == 0


def test_a_waiter_whose_client_left_gives_its_place_up_and_is_never_granted():
    adm = Admission(AdmissionConfig(max_running=1, max_queued=2))
    assert adm.try_enter(1.0) is None
    first = Waiter(adm, "")
    queued(adm, 1)
    second = Waiter(adm, "")
    queued(adm, 2)
    first.gone.set()
    adm.wake()
    left = first.outcome()
    assert left.kind == "gone" and adm.num_queued == 1
    adm.leave()  # the freed slot goes to the one still waiting, not to the one that left
    assert second.outcome() is None and (adm.num_running, adm.num_queued) == (1, 0)


def test_a_tenant_at_its_limits_waits_or_is_refused_while_others_are_admitted():
    adm = Admission(AdmissionConfig(max_running=4, max_queued=8))
    a = TenantLimits(max_running=1, max_queued=1)
    assert adm.try_enter(1.0, "a", a) is None
    second = Waiter(adm, "a", a)  # waits although three slots are free: its tenant is at max_running
    queued(adm, 1)
    refused = adm.try_enter(1.0, "a", a)
    assert refused.kind == "tenant_limit"
    assert refused.message == ("tenant 'a' is at its limits: 1 running (limit max_running 1), 1 queued "
                               "(limit max_queued 1)")
    assert all(adm.try_enter(1.0, "b") is None for _ in range(3))
    assert adm.running_of("a") == (1, 1) and adm.running_of("b") == (3, 0)
    adm.leave("b")
    assert not second.done.wait(0.1), "a free slot does not go to a tenant at its max_running"
    adm.leave("a")
    assert second.outcome() is None and adm.running_of("a") == (1, 0)


@pytest.mark.parametrize("weight_a, first", [(4.0, "a"), (1.0, "b")])
def test_a_free_slot_goes_to_the_fewest_running_per_weight(weight_a, first):
    adm = Admission(AdmissionConfig(max_running=3, max_queued=8))
    a, b = TenantLimits(weight=weight_a), TenantLimits()
    assert adm.try_enter(1.0, "a", a) is None and adm.try_enter(1.0, "a", a) is None
    assert adm.try_enter(1.0, "b", b) is None
    wait_b = Waiter(adm, "b", b)  # b asks first ...
    queued(adm, 1)
    wait_a = Waiter(adm, "a", a)
    queued(adm, 2)
    adm.leave("a")  # ... then running per weight is a 1/w, b 1/1: a weight of 4 puts a first
    winner, loser = (wait_a, wait_b) if first == "a" else (wait_b, wait_a)
    assert winner.outcome() is None and not loser.done.wait(0.1)
    adm.leave(winner.tenant)
    assert loser.outcome() is None


def test_a_full_queue_refuses_the_tenant_over_its_share_first():
    adm = Admission(AdmissionConfig(max_running=1, max_queued=2))
    assert adm.try_enter(1.0, "x") is None
    a1 = Waiter(adm, "a")
    queued(adm, 1)
    a2 = Waiter(adm, "a")
    queued(adm, 2)
    b1 = Waiter(adm, "b")  # the queue is full, and a holds 2 per weight against b's 1
    evicted = a2.outcome()
    assert evicted.kind == "tenant_share" and "tenant 'a' is over its share" in evicted.message
    assert not a1.done.is_set() and not b1.done.is_set() and adm.num_queued == 2
    c = adm.try_enter(1.0, "c")  # a and b hold 1 each: nobody is over c's share
    assert c.kind == "queue_full"
    adm.leave("x")
    assert a1.outcome() is None  # a tie at 0 running: the older request
    adm.leave("a")
    assert b1.outcome() is None and (adm.num_running, adm.num_queued) == (1, 0)
    adm.leave("b")
    assert adm.running_of("a") == adm.running_of("b") == (0, 0)


def test_limits_are_checked():
    with pytest.raises(ValueError, match="weight 0"):
        TenantLimits(weight=0)
    with pytest.raises(ValueError, match="max_running 0"):
        TenantLimits(max_running=0)
    with pytest.raises(ValueError, match="max_queued -1"):
        TenantLimits(max_queued=-1)
