"""The ``tidekv`` command line. Each subcommand is a thin shell over a package's public API."""

from __future__ import annotations

import argparse
import sys
import time

from deploy.settings import setup_torch

DEMO_PROMPT = "Tidekv keeps every finished block of KV cache so the next request does not recompute it. "


def _cmd_generate(args: argparse.Namespace) -> int:
    import torch

    import engine

    setup_torch(args.threads)
    model = engine.load_model(args.model, device=args.device)
    ids = model.tokenizer.encode(args.prompt)
    t0 = time.perf_counter()
    with torch.inference_mode():
        cache = model.new_cache(num_pages=-(-(len(ids) + args.max_tokens) // 32), num_slots=1, block_size=32)
        seq = cache.try_reserve("cli", len(ids) + args.max_tokens)
        params = engine.SamplingParams(args.max_tokens, args.temperature, args.top_p, args.top_k, args.seed)
        params.validate(model.cfg.vocab_size)
        engine.check_prompt(model, ids, args.max_tokens)
        logits = model.prefill(cache, seq, ids)
        t1 = time.perf_counter()
        out = engine.sample(logits, [params], [len(ids)])
        while len(out) < args.max_tokens:
            out += engine.sample(model.decode_step(cache, [seq], [out[-1]]), [params], [seq.num_tokens])
        t2 = time.perf_counter()
    print(model.tokenizer.decode(out))
    decode_tps = (len(out) - 1) / (t2 - t1) if len(out) > 1 else 0.0
    print(f"\nprompt {len(ids)} tokens at {len(ids) / (t1 - t0):.0f} tok/s; "
          f"decode {len(out)} tokens at {decode_tps:.1f} tok/s", file=sys.stderr)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    args.prompt = DEMO_PROMPT * 4
    return _cmd_generate(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tidekv", description="Disaggregated KV-cache serving for Kimi-Linear hybrids")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text with the single-process engine")
    g.add_argument("--prompt", required=True)
    demo = sub.add_parser("demo", help="the README's main job: generate from a fixed prompt")
    for s in (g, demo):
        s.add_argument("--model", default="tiny", help="'tiny' or a checkpoint directory")
        s.add_argument("--max-tokens", type=int, default=64)
        s.add_argument("--temperature", type=float, default=0.0)
        s.add_argument("--top-p", type=float, default=1.0)
        s.add_argument("--top-k", type=int, default=0)
        s.add_argument("--seed", type=int, default=0)
        s.add_argument("--device", default="cpu")
        s.add_argument("--threads", type=int, default=2)
    g.set_defaults(func=_cmd_generate)
    demo.set_defaults(func=_cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # bad input: one clear line, no traceback
        print(f"tidekv: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
