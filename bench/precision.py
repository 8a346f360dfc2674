"""bf16 against INT4 and MXFP4 experts on one config, in one run (``bench.engine`` calls ``run``).

The default config, ``k2-shaped``, is tiny-k2 (DeepSeek-V3 with K2's choices) with K2's
proportions where they decide the comparison: 64 experts, 8 per token, 7 MoE layers, so the
active routed experts are about two thirds of the weight bytes a decode step reads (K2, with 8
of 384 experts: about 70%), and a 256-token prefill chunk gives each expert ~32 rows rather than
the ~64 of the built-in models' 8 experts. ``tiny`` and ``tiny-k2`` run as they are.

For each precision the config's seeded weights are loaded in bf16 from a checkpoint directory:
dense (the baseline), INT4 routed experts (compressed-tensors pack-quantized, as K2-Thinking
ships them) and MXFP4 routed experts (as K3 ships them). Reported: resident weight bytes (all,
and the routed experts alone, with the ratio to bf16), decode tokens/s at batch 1 and 8 over a
cached context, and prefill tokens/s. Precisions alternate round by round, so outside load
hits all three alike; ratios are per round (median, min, max).
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import tempfile
from collections.abc import Callable

import torch

import engine
from bench.common import summary, timed
from engine.checkpoint import expected_shapes, save_checkpoint, seeded_tensors
from engine.config import BUILTIN_CONFIGS, ModelConfig, tiny_k2_config
from engine.quant import INT4, MXFP4, reference
from engine.quant.accounting import weight_bytes

PRECISIONS = ("bf16", "int4", "mxfp4")
FORMATS = {"int4": INT4, "mxfp4": MXFP4}


def k2_shaped() -> ModelConfig:
    return dataclasses.replace(tiny_k2_config(), num_hidden_layers=8, mla_layer_ids=tuple(range(8)), num_experts=64,
                               num_experts_per_token=8, name="k2-shaped")


CONFIGS: dict[str, Callable[[], ModelConfig]] = {"k2-shaped": k2_shaped, **BUILTIN_CONFIGS}


def _models(config_name: str) -> dict[str, engine.HybridModel]:
    cfg = CONFIGS[config_name]()
    dense = seeded_tensors(cfg, 11)
    models = {}
    with tempfile.TemporaryDirectory() as d:
        for name in PRECISIONS:
            path = f"{d}/{name}"
            tensors = dense
            if name in FORMATS:
                qconfig = reference.quantization_config(FORMATS[name])
                tensors = reference.quantize(dense, qconfig, expected_shapes(cfg))
            save_checkpoint(path, cfg, tensors)
            if name in FORMATS:
                reference.write_quantization_config(path, qconfig)
            models[name] = engine.load_model(path, dtype=torch.bfloat16)
    return models


def _decode_step(model: engine.HybridModel, ctx: int, batch: int) -> Callable[[], object]:
    """One decode step of ``batch`` requests over ``ctx`` cached tokens (re-run: positions advance)."""
    cache = model.new_cache(num_pages=batch * (ctx + 512) // 32 + batch, num_slots=batch, block_size=32)
    first = cache.try_reserve("r0", ctx + 480)
    ids = torch.randint(0, 256, (ctx,), generator=torch.Generator().manual_seed(0)).tolist()
    model.prefill(cache, first, ids)
    snap = engine.export_prefix(cache, first, ctx)
    seqs = [first]
    for b in range(1, batch):
        s = cache.try_reserve(f"r{b}", ctx + 480)
        engine.import_prefix(cache, s, snap)
        seqs.append(s)
    return lambda: model.decode_step(cache, seqs, [1] * batch)


def _prefill(model: engine.HybridModel, n: int) -> Callable[[], object]:
    ids = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(1)).tolist()

    def run():
        cache = model.new_cache(num_pages=n // 32 + 1, num_slots=1, block_size=32)
        model.prefill(cache, cache.try_reserve("p", n), ids)

    return run


def _interleaved(fns: dict[str, Callable[[], object]], rounds: int, per_round: int) -> dict[str, list[float]]:
    """Seconds per call of each fn, one sample per round (the median of ``per_round`` calls)."""
    for fn in fns.values():
        fn()  # warm-up
    out: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            out[k].append(timed(fn, per_round, warmup=0)["median_s"])
    return out


def _rows(samples: dict[str, list[float]], tokens_per_call: int) -> dict[str, dict]:
    base = samples["bf16"]
    rows = {}
    for k, s in samples.items():
        ratios = sorted(b / x for b, x in zip(base, s, strict=True))  # tokens/s relative to bf16, per round
        rows[k] = {"tok_s": tokens_per_call / statistics.median(s), "call": summary(s),
                   "vs_bf16": {"median": statistics.median(ratios), "min": ratios[0], "max": ratios[-1]}}
    return rows


def run(config_name: str, quick: bool) -> dict:
    models = _models(config_name)
    result: dict = {"config": config_name, "dtype": "bfloat16", "weights": {}, "decode": [], "prefill": None}
    base = weight_bytes(models["bf16"])
    for k, m in models.items():
        wb = weight_bytes(m)
        result["weights"][k] = {"total_bytes": wb.total, "routed_expert_bytes": wb.routed_experts,
                                "routed_experts_vs_bf16": wb.routed_experts / base.routed_experts,
                                "total_vs_bf16": wb.total / base.total}
    rounds, ctx = (3, 256) if quick else (9, 512)
    with torch.inference_mode():
        for batch in (1, 8):
            fns = {k: _decode_step(m, ctx, batch) for k, m in models.items()}
            rows = _rows(_interleaved(fns, rounds, 5 if quick else 10), batch)
            result["decode"].append({"context": ctx, "batch": batch, **rows})
            print(f"precision decode ctx={ctx} batch={batch}: {_line(rows)}", file=sys.stderr)
        n = 256 if quick else 1024
        rows = _rows(_interleaved({k: _prefill(m, n) for k, m in models.items()}, rounds, 1), n)
        result["prefill"] = {"tokens": n, **rows}
        print(f"precision prefill {n}: {_line(rows)}", file=sys.stderr)
    return result


def _line(rows: dict[str, dict]) -> str:
    return ", ".join(f"{k} {r['tok_s']:.0f} tok/s ({r['vs_bf16']['median']:.2f}x)" for k, r in rows.items())
