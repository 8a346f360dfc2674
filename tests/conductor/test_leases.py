"""``conductor.grpc_dispatch.ReservationLeases``: what a live Conductor renews on each decode
worker, and when it stops (the Decode call or Release, the worker not knowing the id, the
request's deadline), and that ``GrpcDispatcher`` holds from a Reserve to its Decode call or
Release. Each ``renew_now`` is one pass, as the renewal thread makes."""

from __future__ import annotations

from types import SimpleNamespace

from conductor.clock import ManualClock
from conductor.grpc_dispatch import GrpcDispatcher, ReservationLeases
from engine.sampling_params import SamplingParams


class Workers:
    """The decode workers as the leases see them: what each was asked to renew, and the ids
    it holds nothing for; ``down`` ones fail the call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str]]] = []
        self.unknown: set[str] = set()
        self.down: set[str] = set()

    def renew(self, worker_id: str, ids: list[str]) -> list[str]:
        if worker_id in self.down:
            raise ConnectionError(f"{worker_id} unreachable")
        self.calls.append((worker_id, sorted(ids)))
        return [i for i in ids if i in self.unknown]


def test_held_reservations_are_renewed_one_call_per_worker_until_dropped() -> None:
    workers, clock = Workers(), ManualClock()
    leases = ReservationLeases(workers.renew, 5.0, clock=clock.now, background=False)
    leases.hold("d0", "a", ttl_s=30.0, for_s=60.0)
    leases.hold("d0", "b", ttl_s=30.0, for_s=60.0)
    leases.hold("d1", "c", ttl_s=9.0, for_s=60.0)
    leases.renew_now()
    assert sorted(workers.calls) == [("d0", ["a", "b"]), ("d1", ["c"])]
    assert leases.period_s() == 3.0  # a third of the shortest TTL, sooner than the 5 s asked for
    leases.drop("d0", "a")  # its Decode call: the worker took it into its batch
    leases.drop("d1", "c")  # released
    workers.calls.clear()
    leases.renew_now()
    assert workers.calls == [("d0", ["b"])] and leases.held() == {"d0": ["b"]}


def test_an_id_the_worker_does_not_hold_and_one_past_its_deadline_are_no_longer_renewed() -> None:
    workers, clock = Workers(), ManualClock()
    leases = ReservationLeases(workers.renew, 5.0, clock=clock.now, background=False)
    leases.hold("d0", "expired", ttl_s=30.0, for_s=600.0)
    leases.hold("d0", "short", ttl_s=30.0, for_s=10.0)  # a request whose deadline is 10 s away
    leases.hold("d0", "live", ttl_s=30.0, for_s=600.0)
    workers.unknown.add("expired")
    leases.renew_now()
    assert leases.held() == {"d0": ["short", "live"]}
    clock.advance(10.0)
    workers.calls.clear()
    leases.renew_now()
    assert workers.calls == [("d0", ["live"])]


def test_a_worker_that_fails_the_renewal_keeps_its_ids_and_the_others_are_renewed() -> None:
    workers, clock = Workers(), ManualClock()
    leases = ReservationLeases(workers.renew, 5.0, clock=clock.now, background=False)
    leases.hold("d0", "a", ttl_s=30.0, for_s=60.0)
    leases.hold("d1", "b", ttl_s=30.0, for_s=60.0)
    workers.down.add("d0")
    leases.renew_now()
    assert workers.calls == [("d1", ["b"])]
    assert leases.held() == {"d0": ["a"], "d1": ["b"]}  # tried again next time
    workers.down.clear()
    leases.renew_now()
    assert ("d0", ["a"]) in workers.calls


def test_an_interval_of_zero_holds_nothing() -> None:
    workers = Workers()
    leases = ReservationLeases(workers.renew, 0.0)
    leases.hold("d0", "a", ttl_s=30.0, for_s=60.0)
    leases.renew_now()
    assert leases.held() == {} and workers.calls == [] and leases._thread is None


class DecodeStub:
    """A decode worker's stub as ``GrpcDispatcher`` calls it: Reserve answers a 9 s TTL."""

    def __init__(self) -> None:
        self.renewed: list[list[str]] = []

    def Reserve(self, request, timeout):
        return SimpleNamespace(transfer_address="tcp://d0", ttl_s=9.0)

    def Renew(self, request, timeout):
        self.renewed.append(list(request.request_ids))
        return SimpleNamespace(unknown_ids=[])

    def Decode(self, request, timeout):
        return Stream()

    def Release(self, request, timeout):
        return SimpleNamespace(released=True)


class Stream(list):
    def cancel(self) -> None:
        pass


def test_the_dispatcher_holds_a_reservation_from_its_reserve_to_its_decode_call_or_release() -> None:
    stub = DecodeStub()
    cluster = SimpleNamespace(endpoint=lambda worker_id: SimpleNamespace(decode=stub))
    dispatcher = GrpcDispatcher(cluster, renew_s=60.0)  # its thread waits 3 s (a third of the TTL) first
    dispatcher.reserve("d0", "decoded", 16, 4, 30.0)
    dispatcher.reserve("d0", "released", 16, 4, 30.0)
    assert sorted(dispatcher.leases.held()["d0"]) == ["decoded", "released"]
    assert dispatcher.leases.period_s() == 3.0
    dispatcher.leases.renew_now()
    assert [sorted(ids) for ids in stub.renewed] == [["decoded", "released"]]
    assert list(dispatcher.decode("d0", "decoded", 7, SamplingParams(max_new_tokens=4), 16, 30.0,
                                  lambda hook: None)) == []
    dispatcher.release("d0", "released")
    assert dispatcher.leases.held() == {}
