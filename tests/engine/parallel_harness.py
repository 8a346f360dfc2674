"""One rank of a parity run (``tests/engine/test_parallel.py`` starts every rank as a process).

Rank 0 runs every check against the single-rank model of the same checkpoint and writes the
measured differences as JSON to ``--out``; the other ranks follow its schedule. Checks:
prompt logits over several chunks and snapshot points; a batch of two requests prefilled and
then decoded together; greedy and seeded generation; a prefix exported at a snapshot point (the
KDA state gathered in the canonical layout); a prefix imported into the canonical cache (the
sync a reused prefix takes) then prefilled further and decoded; a cache filled the way a
decode worker's transfer sink fills it, then decoded.
"""

from __future__ import annotations

import argparse
import json
import os
import stat

import torch

import engine
from engine.parallel.group import leave_group
from engine.parallel.instance import RankSpec, join
from engine.parallel.leader import GroupModel
from engine.parallel.shape import ParallelShape
from runtime.ranks import exit_now

BLOCK = 16
CHUNK = 48


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item() if a.numel() else 0.0


def _ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _batch(model, ids_a: list[int], ids_b: list[int], steps: int) -> list[torch.Tensor]:
    """Prefill two requests (snapshots at blocks 2 and 5), then decode both ``steps`` times."""
    cache = model.new_cache(num_pages=64, num_slots=2, block_size=BLOCK)
    out, seqs = [], []
    for rid, ids in (("a", ids_a), ("b", ids_b)):
        seq = cache.try_reserve(rid, len(ids) + steps + 1)
        out.append(model.prefill(cache, seq, ids, chunk_tokens=CHUNK, snapshot_at=(2 * BLOCK, 5 * BLOCK)))
        seqs.append(seq)
    tokens = [int(o.argmax()) for o in out[-2:]]
    for _ in range(steps):
        logits = model.decode_step(cache, seqs, tokens)
        out.append(logits)
        tokens = logits.argmax(-1).tolist()
    assert sorted(seqs[0].snapshots) == [2 * BLOCK, 5 * BLOCK], sorted(seqs[0].snapshots)
    snaps = [torch.cat([t.flatten() for p in sorted(s.snapshots) for t in s.snapshots[p]]) for s in seqs]
    return out + snaps


def _reuse(model, ids: list[int], export: engine.CacheExport, steps: int) -> list[torch.Tensor]:
    """A prefix imported into the canonical cache, the rest prefilled, then decoded."""
    cache = model.new_cache(num_pages=64, num_slots=1, block_size=BLOCK)
    seq = cache.try_reserve("r", len(ids) + steps)
    engine.import_prefix(cache, seq, export)
    out = [model.prefill(cache, seq, ids[export.num_tokens:], chunk_tokens=CHUNK)]
    token = int(out[0].argmax())
    for _ in range(steps):
        out.append(model.decode_step(cache, [seq], [token]))
        token = int(out[-1].argmax())
    return out


def _received(model, ids: list[int], export: engine.CacheExport, steps: int) -> list[torch.Tensor]:
    """A decode worker's path: the whole prompt's cache written into the canonical pages and
    slot (as the transfer sink does), then decode steps from its first token."""
    cache = model.new_cache(num_pages=64, num_slots=1, block_size=BLOCK)
    seq = cache.try_reserve("d", export.num_tokens + steps + 1)
    engine.import_prefix(cache, seq, export)
    token, out = ids[-1], []
    for _ in range(steps):
        out.append(model.decode_step(cache, [seq], [token]))
        token = int(out[-1].argmax())
    return out


def _checks(group: GroupModel, ref: engine.HybridModel) -> dict[str, float | bool]:
    vocab = ref.cfg.vocab_size
    prompt = _ids(7 * BLOCK + 5, vocab, 1)
    result: dict[str, float | bool] = {}
    result["prompt_logits"] = _diff(engine.prompt_logits(group, prompt, chunk_tokens=CHUNK),
                                    engine.prompt_logits(ref, prompt, chunk_tokens=CHUNK))
    other = _ids(3 * BLOCK + 9, vocab, 2)
    got, want = _batch(group, prompt, other, 6), _batch(ref, prompt, other, 6)
    result["batch"] = max(_diff(g, w) for g, w in zip(got, want, strict=True))
    for name, kw in (("greedy", {}), ("seeded", {"temperature": 0.9, "top_p": 0.95, "seed": 11})):
        a = engine.generate(group, prompt, 24, **kw)
        b = engine.generate(ref, prompt, 24, **kw)
        result[f"{name}_equal"] = a == b
        result[f"{name}_len"] = len(a)
    # Export at a snapshot point (the canonical KDA state gathered from every rank).
    cache = group.new_cache(num_pages=64, num_slots=1, block_size=BLOCK)
    seq = cache.try_reserve("x", len(prompt))
    group.prefill(cache, seq, prompt, chunk_tokens=CHUNK, snapshot_at=(4 * BLOCK, 7 * BLOCK))
    ref_cache = ref.new_cache(num_pages=64, num_slots=1, block_size=BLOCK)
    ref_seq = ref_cache.try_reserve("x", len(prompt))
    ref.prefill(ref_cache, ref_seq, prompt, chunk_tokens=CHUNK, snapshot_at=(4 * BLOCK, 7 * BLOCK))
    mine, theirs = engine.export_prefix(cache, seq, 4 * BLOCK), engine.export_prefix(ref_cache, ref_seq, 4 * BLOCK)
    result["export"] = max(_diff(mine.mla, theirs.mla), _diff(mine.kda_state, theirs.kda_state),
                           _diff(mine.kda_conv, theirs.kda_conv))
    # Reuse the single rank's export on the group (and the group's on the single rank).
    got, want = _reuse(group, prompt, theirs, 4), _reuse(ref, prompt, theirs, 4)
    result["reuse"] = max(_diff(g, w) for g, w in zip(got, want, strict=True))
    got, want = _reuse(ref, prompt, mine, 4), _reuse(ref, prompt, theirs, 4)
    result["reuse_group_export"] = max(_diff(g, w) for g, w in zip(got, want, strict=True))
    whole = engine.export_prefix(ref_cache, ref_seq, 7 * BLOCK)
    got, want = _received(group, prompt[: 7 * BLOCK + 1], whole, 5), _received(ref, prompt[: 7 * BLOCK + 1], whole, 5)
    result["received"] = max(_diff(g, w) for g, w in zip(got, want, strict=True))
    result["kda_heads_per_rank"] = group.shard.cache_cfg.kda_num_heads
    return result


def _pipeline_checks(group, ref: engine.HybridModel) -> dict[str, float | bool]:
    """A pipelined prefill instance (prefill only): logits and exported blocks, pipelined in
    chunks and not, from scratch and after an imported prefix."""
    prompt = _ids(9 * BLOCK + 7, ref.cfg.vocab_size, 3)
    points = (3 * BLOCK, 6 * BLOCK, 9 * BLOCK)
    result: dict[str, float | bool] = {}

    def run(model, pipe: int, export: engine.CacheExport | None = None):
        cache = model.new_cache(num_pages=64, num_slots=1, block_size=BLOCK)
        seq = cache.try_reserve("p", len(prompt))
        if export is not None:
            engine.import_prefix(cache, seq, export)
        kw = {"pipeline_chunk_tokens": pipe} if pipe else {}
        logits = model.prefill(cache, seq, prompt[seq.num_tokens:], all_logits=True, chunk_tokens=CHUNK,
                               snapshot_at=points, **kw)
        exports = [engine.export_prefix(cache, seq, p) for p in points if p > (export.num_tokens if export else 0)]
        return logits, exports

    want, want_exports = run(ref, 0)
    for name, pipe in (("pipelined", 2 * BLOCK + 5), ("one_chunk", 0)):
        got, exports = run(group, pipe)
        result[f"{name}_logits"] = _diff(got, want)
        result[f"{name}_export"] = max(max(_diff(a.mla, b.mla), _diff(a.kda_state, b.kda_state),
                                           _diff(a.kda_conv, b.kda_conv))
                                       for a, b in zip(exports, want_exports, strict=True))
    prefix = want_exports[0]
    got, _ = run(group, 2 * BLOCK, prefix)
    want, _ = run(ref, 0, prefix)
    result["reuse_logits"] = _diff(got, want)
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--stages", type=int, default=1)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--init", required=True)
    p.add_argument("--out", default="")
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--idle-s", type=float, default=0.0, help="rank 0 waits this long before the checks")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    spec = RankSpec(args.model, ParallelShape(tp=args.tp, ep=args.ep, stages=args.stages), args.rank, args.init,
                    timeout_s=args.timeout_s)
    member = join(spec)
    if args.rank == 0 and args.idle_s:
        import time

        time.sleep(args.idle_s)
    with torch.inference_mode():
        if args.rank == 0:
            checks = _pipeline_checks if args.stages > 1 else _checks
            result = checks(member, engine.load_model(args.model))
            member.close()
            with open(args.out, "w") as f:
                json.dump(result, f)
        else:
            member.run()
    leave_group()
    assert not (fifos := _open_fifos()), f"leave_group left the shared-memory collectives' FIFOs open: {fifos}"
    # Skip the interpreter's finalization: on a loaded host, gloo's threads have aborted it
    # (std::terminate, exit -6) after every check had passed and the result was written.
    exit_now(0)


def _open_fifos() -> list[str]:
    """The named FIFOs this process holds open (pipes without a name are torch's and gloo's)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("/") and stat.S_ISFIFO(os.fstat(int(fd)).st_mode):
                found.append(target)
        except OSError:  # the listing's own descriptor, closed since
            pass
    return found

if __name__ == "__main__":
    main()
