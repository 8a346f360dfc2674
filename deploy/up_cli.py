"""``tidekv up`` and ``tidekv scale``: bring a cluster up and resize its pools.

``tidekv up`` runs a Conductor and its workers as supervised local processes
(``deploy/local.py``), or with ``--ray`` as Ray actors (``deploy/ray_launcher.py``), and
reports where they listen; ``tidekv scale`` resizes a pool of a cluster on Ray. Each adds
its subcommand to the ``tidekv`` parser (``deploy/cli.py``) with ``add_up_parser`` /
``add_scale_parser``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def _ray_config(args: argparse.Namespace):
    """The Ray cluster of ``tidekv up --ray``: role configs from their flags (``--prefill-args``
    ...) over ``TIDEKV_*`` over the defaults, then the ``up`` flags; placement from --ray-*."""
    import dataclasses
    import shlex

    from conductor.config import ConductorConfig
    from decode_worker.config import DecodeConfig
    from deploy.ray_config import Placement, RayClusterConfig, parse_resources
    from prefill_worker.config import PrefillConfig
    from runtime.settings import parse_config

    conductor = parse_config(ConductorConfig, shlex.split(args.conductor_args), prog="--conductor-args")
    conductor = dataclasses.replace(conductor, model=args.model, policy=args.policy, index=args.index,
                                    port=args.port, calibration=args.calibration or conductor.calibration,
                                    api_keys=args.api_keys or conductor.api_keys)
    if not conductor.api_keys:
        conductor = dataclasses.replace(conductor, insecure_no_auth=True)
    prefill = parse_config(PrefillConfig, [*_shape_args(args, "prefill"), *shlex.split(args.prefill_args)],
                           prog="--prefill-args")
    prefill = dataclasses.replace(prefill, model=args.model)
    decode = parse_config(DecodeConfig, [*_shape_args(args, "decode"), *shlex.split(args.decode_args)],
                          prog="--decode-args")
    decode = dataclasses.replace(decode, model=args.model)
    placements = {f"{role}_placement": Placement(args.ray_cpus, parse_resources(getattr(args, f"ray_{role}_resources")),
                                                 strategy)
                  for role, strategy in (("conductor", "PACK"), ("prefill", "PACK"), ("decode", "SPREAD"))}
    from openai_api.config import FrontConfig

    http = FrontConfig(model=args.model, port=max(args.http_port, 0), api_keys=conductor.api_keys)
    return RayClusterConfig(conductor=conductor, prefill=prefill, decode=decode, http=http, num_prefill=args.prefill,
                            num_decode=args.decode, num_http=0 if args.http_port < 0 else 1, namespace=args.namespace,
                            num_conductors=args.conductors, **placements)


def _cmd_up_ray(args: argparse.Namespace) -> int:
    from deploy.ray_launcher import RayCluster, connect, format_reports
    from runtime.service import wait_for_signal

    config = _ray_config(args)
    if args.ray == "local" and args.detach:
        raise ValueError("--detach needs a Ray cluster that outlives this command: --ray ADDRESS")
    if args.ray == "local":  # a Ray instance for this command's life, offering every role's resource
        connect("local", config.namespace, include_dashboard=False, _system_config={"worker_niceness": 0},
                resources={"tidekv_conductor": args.conductors, "tidekv_prefill": 64, "tidekv_decode": 64})
    else:
        connect(args.ray, config.namespace)
    conductors = f"{args.conductors} conductors" if args.conductors > 1 else "conductor"
    print(f"starting {conductors} + {args.prefill} prefill + {args.decode} decode as Ray actors "
          f"(namespace {config.namespace})", file=sys.stderr)
    cluster = RayCluster(config).start()
    try:
        print(format_reports(cluster.reports()), file=sys.stderr)
        http = f", OpenAI HTTP API {cluster.http_url}" if cluster.http_url else ""
        _record_ray_run(args, config.namespace, cluster.endpoint)
        print(f"tidekv cluster ready: endpoint {cluster.endpoint}{http}", flush=True)
        print(f"model files: {_model_files_for_up(args)} (tokenizer and config for peer tools, e.g. "
              f"aiperf --tokenizer)", file=sys.stderr)
        if args.demo:
            from deploy.demo import run_demo

            return run_demo(cluster.endpoint)
        if args.detach:
            return 0
        wait_for_signal("press Ctrl-C to stop")
    finally:
        if not args.detach:
            cluster.stop()
    return 0


def _record_ray_run(args: argparse.Namespace, namespace: str, endpoint: str) -> None:
    """Leaves where the cluster runs for `tidekv status` and `tidekv top` (deploy/ray_status.py)."""
    import ray

    from deploy.ray_status import RayRun, current_auth_mode, write_ray_run
    from deploy.status_cli import new_up_run_dir

    run_dir = Path(args.data_dir) if args.data_dir else new_up_run_dir()
    gcs = ray.get_runtime_context().gcs_address
    path = write_ray_run(run_dir, RayRun(gcs, namespace, endpoint, os.getpid(), time.time(), current_auth_mode()))
    print(f"Ray cluster {gcs}, namespace {namespace} (`tidekv status` reads it; {path})", file=sys.stderr)


def _cmd_scale(args: argparse.Namespace) -> int:
    from deploy.ray_launcher import RayCluster, connect, format_reports

    if args.prefill is None and args.decode is None:
        raise ValueError("tidekv scale: give --prefill N and/or --decode N")
    connect(args.ray, args.namespace)
    cluster = RayCluster.attach(args.namespace)
    for role in ("prefill", "decode"):
        if getattr(args, role) is not None:
            print(f"scaling the {role} pool to {getattr(args, role)} ...", file=sys.stderr)
            cluster.scale(role, getattr(args, role))
    print(format_reports(cluster.reports()))
    return 0


def _calibration_for_up(args: argparse.Namespace) -> str:
    """The cost-model file ``tidekv up`` gives its Conductor: --calibration, else the one keyed
    by model, device and threads in the cache directory, measured now (quick grid, about 15 s on 2 cores,
    announced) when missing. Other policies than mooncake need none."""
    if args.calibration or args.policy != "mooncake":
        return args.calibration
    import engine
    from costmodel import default_calibration_path, ensure_calibration
    from runtime.settings import torch_threads

    threads = torch_threads()
    model = engine.load_model(args.model)
    cache_dir = Path(args.data_dir or "~/.cache/tidekv").expanduser()
    ensure_calibration(cache_dir, model, "cpu", threads, quick=True,
                       log=lambda msg: print(f"tidekv up: {msg}", file=sys.stderr))
    return str(default_calibration_path(cache_dir, model.fingerprint, "cpu", threads))


def _model_files_for_up(args: argparse.Namespace) -> str:
    """The model's Hugging Face-style directory for peer tools (``engine.model_files``), written
    for tiny into the same cache directory as the calibration."""
    from engine.model_files import model_files_dir

    return str(model_files_dir(args.model, args.data_dir or None))


def _shape_args(args: argparse.Namespace, role: str) -> tuple[str, ...]:
    """The worker flags of ``tidekv up``'s parallel shape for ``role`` (each instance a group
    of ranks: ``--tp``, ``--ep`` for both roles; ``--cpp-stages`` for prefill)."""
    out = ("--tp", str(args.tp), "--ep", str(args.ep))
    if role == "prefill" and args.cpp_stages > 1:
        out += ("--cpp-stages", str(args.cpp_stages), "--cpp-chunk-tokens", str(args.cpp_chunk_tokens))
    return out


def _cmd_up(args: argparse.Namespace) -> int:
    if args.ray is None or args.calibration:
        args.calibration = _calibration_for_up(args)
    if args.ray is not None:
        return _cmd_up_ray(args)
    from deploy.local import ClusterConfig, LocalCluster
    from deploy.status_cli import new_up_run_dir, print_state_on_sigusr1
    from runtime.service import wait_for_signal

    run_dir = Path(args.data_dir) if args.data_dir else new_up_run_dir()
    cluster = LocalCluster(ClusterConfig(num_prefill=args.prefill, num_decode=args.decode, model=args.model,
                                         prefill_args=_shape_args(args, "prefill"),
                                         decode_args=_shape_args(args, "decode"),
                                         policy=args.policy, index=args.index, port=args.port,
                                         num_conductors=args.conductors,
                                         index_password_file=args.index_password_file,
                                         data_dir=args.data_dir, calibration=args.calibration,
                                         http_port=args.http_port, supervise=True, log_dir=str(run_dir / "logs"),
                                         api_keys=args.api_keys, tls=args.tls,
                                         state_file=str(run_dir / "state.json")))
    print_state_on_sigusr1(cluster)
    conductors = "conductor"
    if args.conductors > 1:
        store = args.index if args.index != "memory" else "a local redis-server"
        conductors = f"{args.conductors} conductors (sharing their state in {store})"
    print(f"starting {conductors} + {args.prefill} prefill + {args.decode} decode, supervised (logs in "
          f"{cluster.log_dir}; state in {cluster.state_file}: `tidekv status`, or kill -USR1 {os.getpid()})",
          file=sys.stderr)
    with cluster:
        _report_ready(args, cluster)
        if args.demo:
            from deploy.demo import run_demo

            return run_demo(cluster.endpoint, tls_ca=cluster.tls.ca, api_key=os.environ.get("TIDEKV_API_KEY", ""))
        wait_for_signal("press Ctrl-C to stop")
    return 0


def _report_ready(args: argparse.Namespace, cluster) -> None:
    """What a user of a ready ``tidekv up`` needs: the endpoints (stdout), then every address,
    the model files for peer tools, what is (not) protected and the scrape config (stderr)."""
    from deploy.cluster_state import format_endpoints

    http = f", OpenAI HTTP API {cluster.http_url}" if cluster.http_url else ""
    print(f"tidekv cluster ready: endpoint {cluster.endpoints}{http}", flush=True)
    print(f"model files: {_model_files_for_up(args)} (tokenizer and config for peer tools, e.g. "
          f"aiperf --tokenizer)", file=sys.stderr)
    print("\n".join(format_endpoints(cluster.addresses())), file=sys.stderr)
    if not args.api_keys:
        print("WARNING: the public endpoint takes no API key and trusts each request's tenant "
              "(--insecure-no-auth); give --api-keys FILE to require keys", file=sys.stderr)
    if cluster.tls.ca:
        print(f"TLS on every gRPC port, the HTTP front and the workers' /metrics; clients verify with "
              f"--tls-ca {cluster.tls.ca}", file=sys.stderr)
    if args.prometheus:
        from observe.prometheus import write_scrape_config

        path = write_scrape_config(args.prometheus, cluster.metrics_addresses(), tls_ca=cluster.tls.ca)
        print(f"Prometheus scrape config for this cluster: {path} (prometheus --config.file {path})",
              file=sys.stderr)


def _add_ray_flags(up: argparse.ArgumentParser) -> None:
    up.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                    help="run the roles as Ray actors on the cluster at ADDRESS (host:port or auto); "
                         "without ADDRESS, on a new Ray instance for this command's life")
    up.add_argument("--namespace", default="tidekv", help="--ray: the Ray namespace of the actors")
    up.add_argument("--detach", action="store_true", help="--ray ADDRESS: leave the cluster running and return")
    up.add_argument("--ray-cpus", type=float, default=0.25, help="--ray: CPUs each actor asks for")
    for role in ("conductor", "prefill", "decode"):
        up.add_argument(f"--ray-{role}-resources", default=f"tidekv_{role}=1", metavar="NAME=N,...",
                        help=f"--ray: custom resources each {role} actor asks for ('' for none)")
        up.add_argument(f"--{role}-args", default="", metavar="FLAGS",
                        help=f"--ray: flags of `tidekv serve --role {role}`, as one string")


def add_up_parser(sub: argparse._SubParsersAction) -> None:
    up = sub.add_parser("up", help="run a local cluster (Conductor + workers) until Ctrl-C")
    up.add_argument("--prefill", type=int, default=1)
    up.add_argument("--decode", type=int, default=1)
    up.add_argument("--model", default="tiny", help="'tiny' (Kimi Linear), 'tiny-k2' (the K2 architecture) or a "
                                                    "checkpoint directory")
    up.add_argument("--policy", default="mooncake")
    up.add_argument("--conductors", type=int, default=1,
                    help="Conductor replicas over one shared cluster state (> 1: in --index, or a local "
                         "redis-server this command starts; with --ray, --index must name a store every node reaches)")
    up.add_argument("--index", default="memory", help="where the cluster state lives: memory, or a store "
                                                      "(redis://, rediss://, redis+sentinel://HOST:PORT/SERVICE)")
    up.add_argument("--index-password-file", default="", metavar="FILE", help="the store's password (AUTH)")
    up.add_argument("--port", type=int, default=50051)
    up.add_argument("--data-dir", default="", help="logs, state, SSD tiers and the calibration (default: SSD "
                                                   "tiers in a temporary directory, logs and state in "
                                                   "~/.cache/tidekv/up/<time>-<pid>, the calibration in "
                                                   "~/.cache/tidekv)")
    up.add_argument("--calibration", default="", help="cost-model file for the Conductor (default: calibrate "
                                                      "once per model and machine)")
    up.add_argument("--demo", action="store_true", help="run the demo requests, then stop")
    up.add_argument("--http-port", type=int, default=8000, help="OpenAI-compatible HTTP front (0: a free port, "
                                                                "-1: none)")
    up.add_argument("--api-keys", default="", metavar="FILE",
                    help="the public endpoint's API keys (`tidekv apikey add`); without it the endpoint takes "
                         "no key and trusts each request's tenant (--insecure-no-auth, announced)")
    up.add_argument("--tls", action="store_true", help="serve every gRPC port over TLS (certificates made in the "
                                                       "data dir; clients need its tls/ca.pem)")
    up.add_argument("--prometheus", default="", metavar="FILE",
                    help="write a Prometheus scrape config for this cluster's /metrics endpoints to FILE")
    up.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per instance (prefill and decode)")
    up.add_argument("--ep", type=int, default=1, help="expert-parallel ranks per instance (x --tp)")
    up.add_argument("--cpp-stages", type=int, default=1, help="chunked pipeline parallelism: ranks (layer stages) "
                                                              "per prefill instance")
    up.add_argument("--cpp-chunk-tokens", type=int, default=1024, help="--cpp-stages: a pipelined prompt's chunk")
    _add_ray_flags(up)
    up.set_defaults(func=_cmd_up)


def add_scale_parser(sub: argparse._SubParsersAction) -> None:
    scale = sub.add_parser("scale", help="resize a pool of a cluster on Ray (started with `tidekv up --ray`)")
    scale.add_argument("--prefill", type=int, help="prefill workers wanted")
    scale.add_argument("--decode", type=int, help="decode workers wanted")
    scale.add_argument("--ray", default="auto", metavar="ADDRESS", help="the Ray cluster (default: auto)")
    scale.add_argument("--namespace", default="tidekv", help="the Ray namespace of the Tidekv cluster")
    scale.set_defaults(func=_cmd_scale)
