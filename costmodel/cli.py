"""``tidekv calibrate``: the command line over ``costmodel.calibrate``.

``add_calibrate_parser(subparsers)`` registers the subcommand (``func=run_calibrate``) on the
``tidekv`` parser; ``python -m costmodel`` runs the same flags on their own. The file goes to
``--out``, or by default to ``default_calibration_path(--data-dir or ~/.cache/tidekv, ...)``,
where ``ensure_calibration`` (``tidekv up``) looks for it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from costmodel.storage import save_models

DEFAULT_DATA_DIR = "~/.cache/tidekv"


def configure_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the calibrate flags to p (for a subcommand or a standalone parser)."""
    from costmodel.grids import DEFAULT_SNAPSHOT_INTERVAL_BLOCKS, GRIDS
    from engine import DEFAULT_BLOCK_SIZE

    p.add_argument("--model", default="tiny", help="'tiny' or a checkpoint directory")
    p.add_argument("--out", default="", help="calibration file to write (default: keyed file under --data-dir)")
    p.add_argument("--data-dir", default="", help=f"where the keyed file goes (default {DEFAULT_DATA_DIR})")
    p.add_argument("--quick", action="store_true", help="the quick grid (about 15 s on 2 cores) instead of full")
    p.add_argument("--grid", choices=sorted(GRIDS), default=None,
                   help="measurement grid (default: full; 'quick' = --quick; 'smoke' only tests the pipeline)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: TIDEKV_TORCH_THREADS, default 1)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="tokens per block")
    p.add_argument("--snapshot-interval-blocks", type=int, default=DEFAULT_SNAPSHOT_INTERVAL_BLOCKS,
                   help="KDA snapshot spacing of the prefill workers being modelled")
    p.add_argument("--backends", default="", help="transfer backends to measure, e.g. tcp,shm (default: all usable)")
    return p


def add_calibrate_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Registers ``calibrate`` on a ``tidekv`` subparsers object; returns its parser."""
    p = subparsers.add_parser("calibrate", help="measure the engine and transfer engine; write the cost models")
    configure_parser(p)
    p.set_defaults(func=run_calibrate)
    return p


def _grid_name(args: argparse.Namespace) -> str:
    if args.quick and args.grid not in (None, "quick"):
        raise ValueError(f"--quick contradicts --grid {args.grid}")
    return args.grid or ("quick" if args.quick else "full")


def run_calibrate(args: argparse.Namespace) -> int:
    """Measures, fits, writes the file and prints the held-out errors. ValueError for bad flags."""
    import engine
    from costmodel.calibrate import calibrate, default_threads
    from costmodel.model import default_calibration_path

    grid = _grid_name(args)
    threads = args.threads or default_threads()
    if threads <= 0 or args.block_size <= 0 or args.snapshot_interval_blocks <= 0:
        raise ValueError(f"--threads {threads}, --block-size {args.block_size} and --snapshot-interval-blocks "
                         f"{args.snapshot_interval_blocks} must be positive")
    backends = [b for b in args.backends.split(",") if b] or None
    model = engine.load_model(args.model, device=args.device)
    out = Path(args.out) if args.out else default_calibration_path(
        args.data_dir or DEFAULT_DATA_DIR, model.fingerprint, args.device, threads)
    print(f"calibrating model {args.model} ({model.fingerprint}) on {args.device} with {threads} torch threads, "
          f"{grid} grid", file=sys.stderr)
    models = calibrate(model, grid=grid, threads=threads, block_size=args.block_size,
                       snapshot_interval_blocks=args.snapshot_interval_blocks, backends=backends,
                       model_name=args.model)
    save_models(models, out)
    print(f"calibration written to {out} ({models.info.wall_s:.1f} s)")
    print(format_fit_errors(models))
    return 0


def format_fit_errors(models) -> str:
    """The held-out relative errors as a small table, one model per line."""
    lines = [f"{'held-out relative error':<24} {'median':>7} {'max':>7}   fit/held-out points"]
    for name, err in models.fit_errors.items():
        lines.append(f"  {name:<22} {err.median_rel_err:>7.1%} {err.max_rel_err:>7.1%}   "
                     f"{err.num_fit}/{err.num_held_out}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = configure_parser(argparse.ArgumentParser(prog="python -m costmodel", description=__doc__))
    args = parser.parse_args(argv)
    try:
        return run_calibrate(args)
    except ValueError as e:  # bad input or a bad file: one clear line, no traceback
        print(f"tidekv calibrate: error: {e}", file=sys.stderr)
        return 2
