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


class FrontLoad:
    """The real HTTP front (uvicorn, its limits, its metrics in ``registry``) before a Conductor
    that is not there. ``round`` sends answers of every kind the front gives alone (200, 400,
    404, 503) and one connection over its cap of 2, and returns the count of each status. Run
    a round before the first scrape and one after: a labelled series appears with its first
    increment, and rate() sees only increments after its first sample."""

    def __init__(self, registry):
        from openai_api.config import FrontConfig
        from openai_api.service import FrontService
        from runtime.ports import free_port

        self.front = FrontService(FrontConfig(conductor=f"127.0.0.1:{free_port()}", port=0, max_connections=2),
                                  registry)
        self.front.start()

    def round(self, timeout_s: float = 30.0) -> dict[int, int]:
        import socket
        import time

        import httpx

        seen: dict[int, int] = {}
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
        with httpx.Client(base_url=f"http://{self.front.address}", timeout=timeout_s) as h:
            answers = [h.get("/v1/models"), h.get("/health"), h.get("/nowhere"),
                       h.post("/v1/completions", content=b"{not json"),
                       h.post("/v1/completions", json={"model": "gpt-4", "prompt": "hi"}),
                       h.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}),
                       h.post("/v1/chat/completions", json=chat)]
        for r in answers:
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
        held = [socket.create_connection(("127.0.0.1", int(self.front.address.rsplit(":", 1)[1])))
                for _ in range(3)]
        time.sleep(0.5)  # the third is over the cap of 2: answered 503 and closed
        for s in held:
            s.close()
        return seen

    def close(self) -> None:
        self.front.drain(5)
        self.front.stop()
