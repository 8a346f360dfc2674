"""Calibration: measure the real engine and transfer engine on a grid, fit the cost models,
and keep them in a file keyed by (model fingerprint, device, torch threads).

``calibrate`` measures and fits (minutes at most; progress on stderr); ``ensure_calibration``
is what ``tidekv up`` calls: load the keyed file, or calibrate on the quick grid and save.
Side effects: while measuring, ``torch.set_num_threads(threads)`` (restored afterwards) and
``torch.set_flush_denormal(True)`` (left on, as every server runs); temporary files in a
temporary directory (removed); loopback listeners for the transfer engine (closed).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TextIO

import torch

from costmodel.fit import (
    DECODE_TERMS,
    PREFILL_TERMS,
    PolyFit,
    Sample,
    decode_features,
    fit_link,
    fit_samples,
    pooled_error,
    prefill_features,
)
from costmodel.grids import DEFAULT_SNAPSHOT_INTERVAL_BLOCKS, GRIDS, CalibrationGrid
from costmodel.measure_engine import DecodeBench, PrefillBench
from costmodel.measure_transfer import TransferBench
from costmodel.model import BACKENDS, CalibrationInfo, CostModels, LinkCost, default_calibration_path
from costmodel.progress import CalibrationProgress
from costmodel.storage import load_models, save_models
from engine import DEFAULT_BLOCK_SIZE, HybridModel, load_model
from kvstore.blocks import Tier

READ_TIERS = (Tier.DRAM, Tier.SSD)
Split = tuple[list[Sample], list[Sample]]  # (fit, held out)


def default_threads() -> int:
    """TIDEKV_TORCH_THREADS through the one module that reads the environment (default 1)."""
    from runtime.settings import torch_threads

    return torch_threads()


def default_backends() -> tuple[str, ...]:
    """tcp and shm, plus ucx where ucxx imports."""
    from kvstore.transfer import ucx_unavailable_reason

    return ("tcp", "shm") + (("ucx",) if ucx_unavailable_reason() is None else ())


def model_bytes(model: HybridModel) -> tuple[int, int]:
    """(MLA latent bytes of one token over all MLA layers, bytes of one KDA snapshot)."""
    cfg = model.cfg
    element = torch.empty(0, dtype=model.dtype).element_size()
    kv = len(cfg.mla_layer_ids) * cfg.latent_dim * element
    per_layer = cfg.kda_num_heads * cfg.kda_head_dim**2 + cfg.conv_window_len * cfg.conv_channels
    return kv, len(cfg.kda_layer_ids) * per_layer * 4  # KDA state and conv window are fp32


def calibrate(
    model: HybridModel, *, grid: str | CalibrationGrid = "quick", threads: int | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE, snapshot_interval_blocks: int = DEFAULT_SNAPSHOT_INTERVAL_BLOCKS,
    backends: Sequence[str] | None = None, model_name: str = "", stream: TextIO | None = None,
) -> CostModels:
    """Measures on ``grid`` ("quick", "full", "smoke" or a CalibrationGrid) and fits every model.
    CalibrationProgress goes to ``stream`` (stderr by default). ValueError for an unknown grid or backend."""
    if isinstance(grid, str):
        if grid not in GRIDS:
            raise ValueError(f"unknown calibration grid {grid!r}; grids: {sorted(GRIDS)}")
        grid = GRIDS[grid]
    threads = threads or default_threads()
    backends = tuple(backends or default_backends())
    if "tcp" not in backends or not set(backends) <= set(BACKENDS):
        raise ValueError(f"backends {list(backends)}: need 'tcp' (the default link) and only names from {BACKENDS}")
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)
    start = time.perf_counter()
    try:
        prefill = _measure_prefill(model, grid, block_size, snapshot_interval_blocks, stream)
        decode = _measure_decode(model, grid, block_size, stream)
        links, reads = _measure_transfer(model, grid, block_size, snapshot_interval_blocks, backends, stream)
    finally:
        torch.set_num_threads(previous_threads)
    info = CalibrationInfo(
        model_fingerprint=model.fingerprint, model_name=model_name or model.cfg.name, device=str(model.device),
        torch_threads=threads, created_at=datetime.now(UTC).isoformat(timespec="seconds"), grid=grid.name,
        block_size=block_size, snapshot_interval_blocks=snapshot_interval_blocks, torch_version=torch.__version__,
        wall_s=round(time.perf_counter() - start, 2),
    )
    return assemble(model_bytes(model), prefill, decode, links, reads, info)


def assemble(sizes: tuple[int, int], prefill: Split, decode: Split, links: dict[str, Split],
             reads: dict[Tier, Split], info: CalibrationInfo) -> CostModels:
    """Fits every model on its fit samples, scores it on its held-out ones, and builds CostModels."""
    prefill_fit = fit_samples(*prefill, prefill_features)
    decode_fit = fit_samples(*decode, decode_features)
    link_fits = {name: fit_link(*split) for name, split in links.items()}
    read_fits = {tier: fit_link(*split) for tier, split in reads.items()}
    transfer_fits: list[PolyFit] = [f for _, f in [*link_fits.values(), *read_fits.values()]]
    errors = {"prefill": prefill_fit.error, "decode": decode_fit.error, "transfer": pooled_error(transfer_fits)}
    errors.update({f"link.{name}": fit.error for name, (_, fit) in link_fits.items()})
    errors.update({f"read.{tier.name}": fit.error for tier, (_, fit) in read_fits.items()})
    link_costs: dict[str, LinkCost] = {name: cost for name, (cost, _) in link_fits.items()}
    return CostModels(
        kv_bytes_per_token=sizes[0], snapshot_bytes=sizes[1],
        **dict(zip(PREFILL_TERMS, prefill_fit.coefficients, strict=True)),
        **dict(zip(DECODE_TERMS, decode_fit.coefficients, strict=True)),
        links=link_costs, tier_reads={tier: cost for tier, (cost, _) in read_fits.items()},
        fit_errors=errors, info=info,
    )


def _split(points: Sequence[tuple[int, ...]], held_out: Sequence[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """Fit points then held-out points, each once (a held-out point equal to a fit point is dropped)."""
    fit = list(dict.fromkeys(points))
    return fit + [p for p in dict.fromkeys(held_out) if p not in fit]


def _median_samples(points: list[tuple[int, ...]], num_fit: int, repeats: int, label: str,
                    measure: Callable[[tuple[int, ...]], float], x_of: Callable[[tuple[int, ...]], tuple[int, ...]],
                    stream: TextIO | None) -> Split:
    """Measures every point ``repeats`` times, repetitions outermost and each in a fresh seeded
    order: a burst of load from another process then hits one repetition of unrelated points,
    which the median drops, rather than every repetition of neighbouring ones."""
    times: dict[tuple[int, ...], list[float]] = {p: [] for p in points}
    rng = random.Random(len(points))
    with CalibrationProgress(label, len(points) * repeats, stream) as bar:
        for _ in range(repeats):
            for point in rng.sample(points, len(points)):
                times[point].append(measure(point))
                bar.advance()
    samples = [Sample(x_of(p), statistics.median(times[p])) for p in points]
    return samples[:num_fit], samples[num_fit:]


def _warmup_points(points: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The smallest and the largest point: run once, untimed, before a phase. First calls of a
    shape allocate (the allocator's mmap threshold adapts) and pick kernels; timed, they read
    up to 50% slow on this kind of machine."""
    return list(dict.fromkeys([min(points, key=sum), max(points, key=lambda pt: pt[0] * pt[1] + sum(pt))]))


def _measure_prefill(model: HybridModel, grid: CalibrationGrid, block_size: int, interval: int,
                     stream: TextIO | None) -> Split:
    def whole_blocks(points: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        return [(n, p // block_size * block_size) for n, p in points]  # only whole blocks are reused

    fit = list(dict.fromkeys(whole_blocks(grid.prefill_points())))
    points = _split(fit, whole_blocks(grid.prefill_held_out))
    bench = PrefillBench(model, block_size, interval, max_tokens=max(n + p for n, p in points))
    try:
        for point in _warmup_points(points):
            bench.time_s(*point)
        return _median_samples(points, len(fit), grid.prefill_repeats, "prefill",
                               lambda pt: bench.time_s(*pt), lambda pt: pt, stream)
    finally:
        bench.close()


def _measure_decode(model: HybridModel, grid: CalibrationGrid, block_size: int, stream: TextIO | None) -> Split:
    fit = list(dict.fromkeys(grid.decode_points()))
    points = _split(fit, grid.decode_held_out)
    bench = DecodeBench(model, block_size, max_batch=max(b for b, _ in points),
                        max_context=max(c for _, c in points), max_steps=grid.decode_steps)
    for b, c in _warmup_points(points):
        bench.time_s(b, c, 1)
    return _median_samples(points, len(fit), grid.decode_repeats, "decode",
                           lambda pt: bench.time_s(*pt, grid.decode_steps), lambda pt: (pt[0], pt[0] * pt[1]), stream)


def _measure_transfer(model: HybridModel, grid: CalibrationGrid, block_size: int, interval: int,
                      backends: tuple[str, ...], stream: TextIO | None) -> tuple[dict[str, Split], dict[Tier, Split]]:
    routes: tuple[str | Tier, ...] = (*READ_TIERS, *backends)
    fit = list(dict.fromkeys(grid.transfer_blocks))
    counts = [p[0] for p in _split([(k,) for k in fit], [(k,) for k in grid.transfer_held_out])]
    paths = [(route, k) for k in counts for route in routes]  # every fit count first, then held-out ones
    bench = TransferBench(model, block_size, interval, counts, backends)
    try:
        for route in routes:  # warm-up: connections, buffers, the SSD files' metadata
            bench.time_s(route, max(counts))
        fit_s, held_s = _median_samples(paths, len(fit) * len(routes), grid.transfer_repeats, "transfer",
                                        lambda pt: bench.time_s(*pt), lambda pt: pt, stream)
        by_route: dict[str | Tier, Split] = {route: ([], []) for route in routes}
        for part, samples in ((0, fit_s), (1, held_s)):
            for s in samples:
                route, k = s.x
                by_route[route][part].append(Sample((bench.num_bytes(k),), s.seconds))
    finally:
        bench.close()
    return {b: by_route[b] for b in backends}, {t: by_route[t] for t in READ_TIERS}


def ensure_calibration(
    data_dir: str | Path, model: str | HybridModel, device: str, threads: int, *, quick: bool = True,
    log: Callable[[str], object] = print, block_size: int = DEFAULT_BLOCK_SIZE,
    snapshot_interval_blocks: int = DEFAULT_SNAPSHOT_INTERVAL_BLOCKS, grid: str | None = None,
) -> CostModels:
    """The calibration for (model, device, threads) under data_dir: loaded when the keyed file
    exists (CalibrationError if it is corrupt or for another setup: never silently replaced),
    else measured (the quick grid unless quick=False; ``grid`` overrides both), saved, and
    announced through ``log``. ``model``: a name or path for ``engine.load_model``, or a model."""
    name = model if isinstance(model, str) else model.cfg.name
    loaded = load_model(model, device=device) if isinstance(model, str) else model
    path = default_calibration_path(data_dir, loaded.fingerprint, device, threads)
    if path.exists():
        return load_models(path, model_fingerprint=loaded.fingerprint, device=device, threads=threads)
    grid = grid or ("quick" if quick else "full")
    log(f"tidekv: no calibration for model {name} on {device} with {threads} torch threads; "
        f"measuring ({grid} grid) ...")
    models = calibrate(loaded, grid=grid, threads=threads, block_size=block_size,
                       snapshot_interval_blocks=snapshot_interval_blocks, model_name=name)
    save_models(models, path)
    log(f"tidekv: calibration saved to {path} ({models.info.wall_s:.0f} s)")
    return models
