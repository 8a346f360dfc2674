"""The ``tidekv`` command line. Each subcommand is a thin shell over a package's public API.

Here: the parser's root, ``main``, and ``generate``, ``demo`` and ``serve``; the other subcommands
come with their own modules' ``add_*_parser`` (``deploy/up_cli.py`` for ``up`` and ``scale``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from runtime.settings import setup_torch


def _cmd_generate(args: argparse.Namespace) -> int:
    if args.endpoint:
        return _generate_remote(args)
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


def _generate_remote(args: argparse.Namespace) -> int:
    import grpc

    from conductor.client import Client

    client = Client(args.endpoint, api_key=args.api_key, tls_ca=args.tls_ca)
    req = Client.request(args.prompt, args.max_tokens, args.temperature, args.top_p, args.top_k, args.seed,
                         tenant=args.tenant)
    try:
        out = client.generate(req)
    except grpc.RpcError as e:
        print(f"tidekv: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    print(out.text)
    print(f"\n{out.finish_reason}: {len(out.token_ids)} tokens, prompt {out.prompt_tokens} "
          f"(cached {out.cached_tokens}), TTFT {out.ttft_s * 1e3:.0f} ms, {out.decode_tokens_per_s:.1f} tok/s "
          f"[{out.prefill_worker} -> {out.decode_worker}]", file=sys.stderr)
    return 0 if out.finish_reason in ("stop", "length") else 1


def _cmd_serve(args: argparse.Namespace, rest: list[str]) -> int:
    setup_torch()
    if args.role == "conductor":
        from conductor.server import serve
    elif args.role == "prefill":
        from prefill_worker.server import serve
    elif args.role == "http":
        from openai_api.service import serve
    else:
        from decode_worker.server import serve
    serve(rest)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from deploy.demo import run_demo
    from deploy.local import ClusterConfig, LocalCluster

    print("starting a local cluster: conductor + 2 prefill + 1 decode workers on 127.0.0.1 ...", file=sys.stderr)
    with LocalCluster(ClusterConfig(num_prefill=2, num_decode=1, model=args.model)) as cluster:
        print(f"cluster ready at {cluster.endpoint}", file=sys.stderr)
        return run_demo(cluster.endpoint)


def _add_generate_parser(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="generate text: through a cluster (--endpoint) or in this process")
    g.add_argument("--prompt", required=True)
    g.add_argument("--endpoint", default="", help="host:port of a Conductor; empty = single-process engine")
    g.add_argument("--tenant", default="")
    g.add_argument("--api-key", default=os.environ.get("TIDEKV_API_KEY", ""),
                   help="--endpoint: the cluster's API key (default: $TIDEKV_API_KEY)")
    g.add_argument("--tls-ca", default="", help="--endpoint: PEM CA of a Conductor serving TLS")
    g.add_argument("--model", default="tiny", help="'tiny', 'tiny-k2' or a checkpoint directory")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", default="cpu")
    g.add_argument("--threads", type=int, default=2)
    g.set_defaults(func=_cmd_generate)


def _add_demo_parser(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser("demo", help="the README's main job: start a local cluster, run a demo, stop it")
    demo.add_argument("--model", default="tiny")
    demo.set_defaults(func=_cmd_demo)


def _add_serve_parser(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="run one process of a cluster", add_help=False)
    serve.add_argument("--role", required=True, choices=["conductor", "prefill", "decode", "http"])
    serve.set_defaults(func=_cmd_serve)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tidekv", description="Disaggregated KV-cache serving for Kimi-Linear hybrids")
    sub = p.add_subparsers(dest="command", required=True)
    _add_generate_parser(sub)
    _add_demo_parser(sub)
    from deploy.up_cli import add_scale_parser, add_up_parser

    add_up_parser(sub)
    add_scale_parser(sub)
    from costmodel.cli import add_calibrate_parser
    from replay.cli import add_replay_parser, add_report_parser
    from replay.sim.cli import add_simulate_parser

    add_calibrate_parser(sub)
    add_replay_parser(sub)
    add_report_parser(sub)
    add_simulate_parser(sub)
    from observe.dashboard_cli import add_dashboard_parser
    from observe.top import add_top_parser

    add_top_parser(sub)
    add_dashboard_parser(sub)
    from deploy.security_cli import add_security_parsers
    from deploy.status_cli import add_status_parser

    add_security_parsers(sub)
    add_status_parser(sub)
    _add_serve_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from proto.build import build

    build()  # the gRPC modules are build outputs: (re)generate them if missing or stale
    args, rest = build_parser().parse_known_args(argv)
    if args.command == "serve":
        return _cmd_serve(args, rest)
    if rest:
        build_parser().error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return args.func(args)
    except ValueError as e:  # bad input: one clear line, no traceback
        print(f"tidekv: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
