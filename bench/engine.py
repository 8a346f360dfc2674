"""Engine benchmark against transformers' KimiLinearForCausalLM (same config, same weights).

Prints JSON: decode step time at batch 1 and 8 for contexts 512 and 2048, and prefill
tokens/s for 2048 and 8192 tokens, for both implementations, with ratios (ours / theirs) and
their spread. ``prefill`` is the 2,048-token row; ``prefill_rows`` has every length. The two
implementations alternate repeat by repeat, so load from other processes hits both alike.
``precision`` (``bench/precision.py``): on one config (``--precision-model``, default k2-shaped:
tiny-k2 with K2's expert proportions), in bf16, the dense model against INT4 and MXFP4 routed
experts: resident weight bytes, decode tokens/s at batch 1 and 8, prefill tokens/s, each with
its ratio to bf16.
Usage: python -m bench.engine [--quick] [--threads N] [--prefill-only] [--precision-only]
       [--precision-model k2-shaped|tiny|tiny-k2]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

import torch

import engine
from bench import precision
from bench.common import summary, timed
from engine.checkpoint import save_checkpoint, seeded_tensors
from engine.config import tiny_config


def _ours_decode(model, ctx: int, batch: int, steps: int) -> dict:
    cache = model.new_cache(num_pages=batch * (ctx + steps + 64) // 32 + batch, num_slots=batch, block_size=32)
    first = cache.try_reserve("r0", ctx + steps + 32)
    ids = torch.randint(0, 256, (ctx,), generator=torch.Generator().manual_seed(0)).tolist()
    model.prefill(cache, first, ids)
    snap = engine.export_prefix(cache, first, ctx)
    seqs = [first]
    for b in range(1, batch):  # clone the prefilled cache instead of prefilling again
        s = cache.try_reserve(f"r{b}", ctx + steps + 32)
        engine.import_prefix(cache, s, snap)
        seqs.append(s)
    tok = [1] * batch
    return timed(lambda: model.decode_step(cache, seqs, tok), repeats=steps, warmup=2)


def _hf_decode(hf, ctx: int, batch: int, steps: int) -> dict:
    from transformers import DynamicCache

    ids = torch.randint(0, 256, (1, ctx), generator=torch.Generator().manual_seed(0)).expand(batch, -1)
    cache = DynamicCache(config=hf.config)
    hf(ids, cache=cache, use_cache=True)
    tok = torch.ones(batch, 1, dtype=torch.long)
    return timed(lambda: hf(tok, cache=cache, use_cache=True), repeats=steps, warmup=2)


def _prefill(model, hf, n: int, repeats: int) -> dict:
    ids = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(1)).tolist()

    def ours():
        cache = model.new_cache(num_pages=n // 32 + 1, num_slots=1, block_size=32)
        model.prefill(cache, cache.try_reserve("p", n), ids)

    def theirs():
        hf(torch.tensor([ids]), logits_to_keep=1)

    ours(), theirs()  # warm-up
    o_s, t_s = [], []
    for _ in range(repeats):  # interleaved: a burst of outside load lands on both
        o_s.append(timed(ours, 1, warmup=0)["median_s"])
        t_s.append(timed(theirs, 1, warmup=0)["median_s"])
    o, t = summary(o_s), summary(t_s)
    pairs = sorted(b / a for a, b in zip(o_s, t_s, strict=True))
    return {
        "tokens": n,
        "ours_tok_s": n / o["median_s"], "transformers_tok_s": n / t["median_s"],
        "ours": o, "transformers": t, "speedup": t["median_s"] / o["median_s"],
        "speedup_per_repeat": [round(p, 3) for p in pairs],
        "ours_spread_pct": round(100 * (o["max_s"] - o["min_s"]) / o["median_s"], 1),
        "transformers_spread_pct": round(100 * (t["max_s"] - t["min_s"]) / t["median_s"], 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer repeats, smaller contexts")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill-only", action="store_true", help="skip the decode rows")
    ap.add_argument("--precision-only", action="store_true", help="only bf16 against INT4 and MXFP4")
    ap.add_argument("--precision-model", default="k2-shaped", choices=sorted(precision.CONFIGS))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    precision_rows = precision.run(args.precision_model, args.quick)
    if args.precision_only:
        print(json.dumps({"threads": args.threads, "precision": precision_rows}, indent=2))
        return
    from transformers import KimiLinearForCausalLM

    cfg = tiny_config()
    with tempfile.TemporaryDirectory() as d:
        save_checkpoint(d, cfg, seeded_tensors(cfg, 11))
        model = engine.load_model(d)
        hf = KimiLinearForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    steps = 5 if args.quick else 20
    contexts = () if args.prefill_only else (512,) if args.quick else (512, 2048)
    result: dict = {"config": cfg.name, "threads": args.threads, "decode": [], "prefill": None}
    with torch.inference_mode():
        for ctx in contexts:
            for batch in (1, 8):
                o = _ours_decode(model, ctx, batch, steps)
                t = _hf_decode(hf, ctx, batch, steps)
                result["decode"].append({
                    "context": ctx, "batch": batch, "ours_ms": o["median_s"] * 1e3,
                    "transformers_ms": t["median_s"] * 1e3, "ratio": o["median_s"] / t["median_s"],
                    "ours": o, "transformers": t,
                })
                print(f"decode ctx={ctx} batch={batch}: ours {o['median_s'] * 1e3:.1f} ms, "
                      f"transformers {t['median_s'] * 1e3:.1f} ms", file=sys.stderr)
        lengths = (512,) if args.quick else (2048, 8192)
        result["prefill_rows"] = [_prefill(model, hf, n, 2 if args.quick else (5 if n <= 2048 else 3)) for n in lengths]
        result["prefill"] = result["prefill_rows"][0]
        for row in result["prefill_rows"]:
            print(f"prefill {row['tokens']}: ours {row['ours_tok_s']:.0f} tok/s, transformers "
                  f"{row['transformers_tok_s']:.0f} tok/s, speedup {row['speedup']:.2f}", file=sys.stderr)
    result["precision"] = precision_rows
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
