"""Child-process peer for the transfer tests (``test_transfer_contract.py``, ``test_transfer_shm.py``),
and the data both sides agree on.

``send`` mode connects to a receiver and pushes one request of the shared layout built from a
seed; it imports no torch, so it starts fast. ``receive`` mode (imports torch) listens, expects
the given requests into a page pool (behind a slow sink with ``--sink-delay-s``, which shm
reaches through its ring; without one, shm senders write into the pool directly) and reports
a digest of what landed; ``--announce-layer L`` also reports (event "layer") once layer L of
a request has landed, with the receiver's count of direct frames; ``--hold-open`` keeps its
connections open after its reports until a line arrives on stdin (a receiver that exits at once
closes the link under a sender still reading its verdict). Both take ``--auth-key HEX``
(``TransferConfig.auth_key``) and ``--encrypt`` (``TransferConfig.encrypt``). Every report is
one JSON line on stdout.

``make_destination`` builds the page pool in shareable memory by default, as a decode worker's
cache is, so shm senders write into it directly; ``shared=False`` keeps it private (the ring).

Scenarios of ``send``:
  full    push every chunk and finish; report the verdict
  hold    push the first token chunk of every MLA layer, flush, report "ready", then wait for
          a line on stdin before finishing (for kill and deadline tests)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np

from kvstore.transfer import FaultInjection, Kind, TransferConfig, TransferError, connect
from kvstore.transfer.base import Address
from kvstore.transfer.registry import get_backend


@dataclass(frozen=True)
class Layout:
    """A small Kimi-Linear-like request: KDA,KDA,KDA,MLA x2; 96 tokens in 3 chunks of 32."""

    mla_layers: tuple[int, ...] = (3, 7)
    kda_layers: tuple[int, ...] = (0, 1, 2, 4, 5, 6)
    num_tokens: int = 96
    chunk_tokens: int = 32
    latent_dim: int = 64
    kda_state_shape: tuple[int, ...] = (2, 16, 16)
    kda_conv_shape: tuple[int, ...] = (3, 32)
    block_size: int = 16

    @property
    def num_units(self) -> int:
        return len(self.mla_layers) + len(self.kda_layers)

    @property
    def chunks(self) -> list[tuple[int, int]]:
        return [
            (t, min(t + self.chunk_tokens, self.num_tokens))
            for t in range(0, self.num_tokens, self.chunk_tokens)
        ]


LAYOUT = Layout()


def source(seed: int, layout: Layout = LAYOUT) -> dict[tuple[str, int], np.ndarray]:
    """Deterministic float32 source tensors keyed by (part, layer)."""
    rng = np.random.default_rng(seed)
    data: dict[tuple[str, int], np.ndarray] = {}
    for layer in layout.mla_layers:
        data["mla", layer] = rng.standard_normal((layout.num_tokens, layout.latent_dim), dtype=np.float32)
    for layer in layout.kda_layers:
        data["state", layer] = rng.standard_normal(layout.kda_state_shape, dtype=np.float32)
        data["conv", layer] = rng.standard_normal(layout.kda_conv_shape, dtype=np.float32)
    return data


def digest(parts: dict[tuple[str, int], np.ndarray]) -> str:
    """Order-independent-key, byte-exact digest of a set of tensors."""
    h = hashlib.sha256()
    for key in sorted(parts):
        h.update(repr(key).encode())
        h.update(np.ascontiguousarray(parts[key]).tobytes())
    return h.hexdigest()


def send_chunks(tx, rid: str, data, chunks: list[tuple[int, int]], layout: Layout = LAYOUT) -> None:
    """Push MLA rows of ``chunks`` layer by layer, as a prefill loop would."""
    for t0, t1 in chunks:
        for layer in sorted(layout.mla_layers):
            tx.send(rid, layer, Kind.MLA_ROWS, (t0, t1), data["mla", layer][t0:t1])


def send_states(tx, rid: str, data, layout: Layout = LAYOUT) -> None:
    for layer in layout.kda_layers:
        tx.send(rid, layer, Kind.KDA_STATE, (0, layout.num_tokens), data["state", layer])
        tx.send(rid, layer, Kind.KDA_CONV, (0, layout.num_tokens), data["conv", layer])


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def become(uid: int, scheme: str) -> None:
    """Drops to ``uid`` with everything the sender will run already imported: that user may
    not be able to read the checkout or its .venv (a clone under a 0700 directory), so nothing
    may be imported from them after the switch. The working directory moves to ``/`` for the
    same reason."""
    get_backend(scheme)  # the backend's module (shm, tcp) loads lazily, on the first connect
    os.chdir("/")
    os.setuid(uid)


def run_send(args: argparse.Namespace) -> None:
    config = TransferConfig(
        deadline_s=args.deadline_s,
        max_inflight_bytes=args.max_inflight_bytes,
        max_frame_bytes=args.max_frame_bytes,
        auth_key=bytes.fromhex(args.auth_key),
        encrypt=args.encrypt,
    )
    faults = FaultInjection(corrupt_seq=args.corrupt_seq, truncate_seq=args.truncate_seq)
    data = source(args.seed)
    if args.as_uid is not None:  # a peer of another user (the test runs as root)
        become(args.as_uid, Address.parse(args.address).scheme)
    try:
        tx = connect(args.address, config, faults=faults)
    except TransferError as exc:
        emit(event="done", error=f"connect failed: {exc}")
        return
    error = None
    try:
        if args.scenario == "hold":
            send_chunks(tx, args.rid, data, LAYOUT.chunks[:1])
            tx.flush()
            emit(event="ready")
            sys.stdin.readline()
        send_chunks(tx, args.rid, data, LAYOUT.chunks[1:] if args.scenario == "hold" else LAYOUT.chunks)
        send_states(tx, args.rid, data)
        tx.finish(args.rid, LAYOUT.num_units)
    except TransferError as exc:
        error = str(exc)
    stats = tx.stats()
    tx.close()
    emit(
        event="done",
        error=error,
        high_water_bytes=stats.inflight_high_water_bytes,
        backpressure_waits=stats.num_backpressure_waits,
        frames_sent=stats.frames_sent,
    )


class SlowSink:
    """A PagePoolSink that takes ``delay_s`` per chunk (a busy destination)."""

    def __init__(self, inner, delay_s: float):
        self.inner = inner
        self.delay_s = delay_s

    def write(self, kind, layer, token_start, token_end, tensor) -> None:
        time.sleep(self.delay_s)
        self.inner.write(kind, layer, token_start, token_end, tensor)


def make_destination(layout: Layout = LAYOUT, shared: bool = True):
    """A page pool with a scrambled page table plus KDA tensors, and its Expected. ``shared``:
    in shareable memory (as a decode worker's cache), so shm senders write into it directly;
    otherwise private memory, reached through the shm ring."""
    import torch

    from kvstore.transfer import Expected, PagePoolSink

    def alloc(shape, fill: float) -> torch.Tensor:
        tensor = torch.full(shape, fill)
        return tensor.share_memory_() if shared else tensor

    num_pages = layout.num_tokens // layout.block_size
    pool = alloc((len(layout.mla_layers), num_pages + 3, layout.block_size, layout.latent_dim), float("nan"))
    page_table = torch.randperm(num_pages + 3, generator=torch.Generator().manual_seed(7))[:num_pages]
    state = {layer: alloc(layout.kda_state_shape, 0.0) for layer in layout.kda_layers}
    conv = {layer: alloc(layout.kda_conv_shape, 0.0) for layer in layout.kda_layers}
    slots = {layer: i for i, layer in enumerate(sorted(layout.mla_layers))}
    sink = PagePoolSink(pool, page_table, slots, state, conv)
    expected = Expected(
        mla_layers=layout.mla_layers,
        token_start=0,
        token_end=layout.num_tokens,
        mla_row_shape=(layout.latent_dim,),
        kda_layers=layout.kda_layers,
        kda_state_shape=layout.kda_state_shape,
        kda_conv_shape=layout.kda_conv_shape,
    )
    return sink, expected


def received(sink, layout: Layout = LAYOUT) -> dict[tuple[str, int], np.ndarray]:
    """What landed in the destination, keyed like ``source``."""
    parts = {
        ("mla", layer): sink.gather_rows(layer, 0, layout.num_tokens).numpy() for layer in layout.mla_layers
    }
    for layer in layout.kda_layers:
        parts["state", layer] = sink.kda_state[layer].numpy()
        parts["conv", layer] = sink.kda_conv[layer].numpy()
    return parts


def run_receive(args: argparse.Namespace) -> None:
    from kvstore.transfer import Receiver

    config = TransferConfig(deadline_s=args.deadline_s, auth_key=bytes.fromhex(args.auth_key), encrypt=args.encrypt)
    rx = Receiver(config, backends=args.backend)
    sinks = {}
    for rid in args.rids.split(","):
        sink, expected = make_destination()
        sinks[rid] = sink
        rx.expect(rid, SlowSink(sink, args.sink_delay_s) if args.sink_delay_s else sink, expected)
    emit(event="listening", address=rx.address)

    def wait(rid: str) -> None:
        try:
            if args.announce_layer is not None:
                rx.wait_layer(rid, args.announce_layer)
                emit(event="layer", rid=rid, frames_direct=rx.frames_direct)
            rx.wait_complete(rid)
            emit(event="result", rid=rid, error=None, digest=digest(received(sinks[rid])))
        except TransferError as exc:
            emit(event="result", rid=rid, error=str(exc), digest=None)

    waiters = [threading.Thread(target=wait, args=(rid,)) for rid in sinks]
    for thread in waiters:
        thread.start()
    for thread in waiters:
        thread.join()
    if args.hold_open:
        sys.stdin.readline()
    rx.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="mode", required=True)
    send = sub.add_parser("send")
    send.add_argument("--address", required=True)
    send.add_argument("--rid", required=True)
    send.add_argument("--scenario", choices=("full", "hold"), default="full")
    send.add_argument("--seed", type=int, default=0)
    send.add_argument("--corrupt-seq", type=int)
    send.add_argument("--truncate-seq", type=int)
    send.add_argument("--deadline-s", type=float, default=20.0)
    send.add_argument("--max-inflight-bytes", type=int, default=8 << 20)
    send.add_argument("--max-frame-bytes", type=int, default=1 << 20)
    send.add_argument("--as-uid", type=int, help="drop to this uid before connecting")
    send.add_argument("--auth-key", default="", help="TransferConfig.auth_key, hex")
    send.add_argument("--encrypt", action="store_true", help="TransferConfig.encrypt")
    receive = sub.add_parser("receive")
    receive.add_argument("--backend", required=True)
    receive.add_argument("--rids", required=True)
    receive.add_argument("--sink-delay-s", type=float, default=0.0)
    receive.add_argument("--deadline-s", type=float, default=20.0)
    receive.add_argument("--announce-layer", type=int, help="report when this layer of a request has landed")
    receive.add_argument("--auth-key", default="", help="TransferConfig.auth_key, hex")
    receive.add_argument("--encrypt", action="store_true", help="TransferConfig.encrypt")
    receive.add_argument("--hold-open", action="store_true", help="close only after a line on stdin")
    args = parser.parse_args()
    run_send(args) if args.mode == "send" else run_receive(args)


if __name__ == "__main__":
    main()
