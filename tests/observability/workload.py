"""A bounded workload over the in-process cluster that makes every dashboard series move:
cached and uncached requests in three tenants, prefixes demoted to SSD and promoted back,
200 requests with distinct tenants, one rejection by SLO and one at admission, one invalid,
one failed and one cancelled request, and a corrupted and an aborted transfer."""

from __future__ import annotations

from kvstore.transfer.base import Expected, FaultInjection, TransferError
from kvstore.transfer.frames import Kind
from kvstore.transfer.sender import connect
from kvstore.transfer.sinks import BlobSink
from tests.observability.inproc import InProcCluster, Seen

ALLOWED_TENANTS = ("acme", "globex")
NUM_DISTINCT_TENANTS = 200


def prompt(n: int, salt: int) -> list[int]:
    return [(i * 131 + salt * 7919) % 250 + 1 for i in range(n)]


def run_requests(c: InProcCluster) -> list[Seen]:
    seen: list[Seen] = []
    for salt, tenant in enumerate((*ALLOWED_TENANTS, ""), start=1):
        base = prompt(80, salt)
        for i in range(3):  # the first computes the shared prefix, the others reuse it
            seen.append(c.serve(c.request(base + prompt(9 + i, 300 + i), 5, tenant=tenant)))
    # Distinct tenants, one short request each: their blocks push the prefixes above down to SSD.
    for i in range(NUM_DISTINCT_TENANTS):
        seen.append(c.serve(c.request(prompt(17, 1000 + i), 1, tenant=f"tenant-{i}")))
    base = prompt(80, 1)  # acme's prefix
    seen.append(c.serve(c.request(base + prompt(12, 400), 5, tenant="acme")))  # hits SSD: a promotion
    seen.append(c.serve(c.request(prompt(40, 5), 4, tenant="acme", ttft_slo_s=1e-6)))  # rejected: TTFT SLO
    seen.append(c.refuse_at_admission("globex"))
    seen.append(c.invalid())
    c.dispatcher.fail_next = True
    seen.append(c.serve(c.request(prompt(40, 6), 4)))  # failed: internal
    seen.append(c.serve(c.request(prompt(40, 7), 24), cancel_after_tokens=2))  # the client goes away
    return seen


def faulty_transfers(c: InProcCluster) -> None:
    """One frame corrupted in transit (a checksum failure) and one transfer aborted by its sender."""
    receiver = c.receiver
    receiver.expect("corrupt-1", BlobSink(), Expected(num_blobs=1), 10.0)
    receiver.expect("abort-1", BlobSink(), Expected(num_blobs=2), 10.0)
    sender = connect(receiver.address, faults=FaultInjection(corrupt_seq=1))
    try:
        sender.send("corrupt-1", 0, Kind.BLOB, (0, 0), b"x" * 4096)
        try:
            sender.finish("corrupt-1", 1, timeout_s=10.0)
            raise AssertionError("a corrupted frame was accepted")
        except TransferError:
            pass
        sender.send("abort-1", 0, Kind.BLOB, (0, 0), b"y" * 4096)
        sender.abort("abort-1", "test: the sender gives up")
        sender.flush(timeout_s=10.0)
    finally:
        sender.close()
    for rid in ("corrupt-1", "abort-1"):
        try:
            receiver.wait_complete(rid, 10.0)
        except TransferError:
            continue
        raise AssertionError(f"transfer {rid} completed")
