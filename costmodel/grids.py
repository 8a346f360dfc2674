"""The measurement grids of ``tidekv calibrate``: which points are measured, which are held
out of the fit to score it, and how many repetitions each gets.

Held-out points lie between the fit grid's lines (never on them), so their error measures
interpolation, the way the Conductor uses the models. Reused prefixes are rounded down to a
whole number of blocks when the block size does not divide them.

- ``quick``: under ~30 s on a 2-core machine (``tidekv up`` runs it on first start). Its
  prompts reach 2,048 new tokens after 4,096 reused, so the Conductor's predictions for the
  prompts it accepts (up to 8,000 tokens) interpolate or extrapolate little: a grid of at
  most 384 new tokens put the n*n term's error, 5-6x at 6,000-8,000 new tokens, into every
  long prefill (a 3 s prefill predicted at 15 s, and rejected against a 10 s SLO);
- ``full``: a few minutes, wider and denser;
- ``smoke``: a few seconds, for tests of the pipeline; its fit is coarse.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_SNAPSHOT_INTERVAL_BLOCKS = 4  # the prefill worker's --snapshot-interval-blocks default


@dataclass(frozen=True)
class CalibrationGrid:
    """Points to measure. Prefill: (new, reused) tokens; decode: (batch size, context tokens per
    request); transfer: number of blocks per pull."""

    name: str
    prefill_new: tuple[int, ...]
    prefill_reused: tuple[int, ...]
    prefill_held_out: tuple[tuple[int, int], ...]
    prefill_repeats: int
    decode_batch: tuple[int, ...]
    decode_context: tuple[int, ...]
    decode_held_out: tuple[tuple[int, int], ...]
    decode_steps: int
    decode_repeats: int
    transfer_blocks: tuple[int, ...]
    transfer_held_out: tuple[int, ...]
    transfer_repeats: int

    def __post_init__(self) -> None:
        counts = (self.prefill_repeats, self.decode_steps, self.decode_repeats, self.transfer_repeats)
        if min(counts) <= 0:
            raise ValueError(f"grid {self.name}: repeats/steps must be positive, got {counts}")
        if min(self.prefill_new + self.decode_batch + self.decode_context + self.transfer_blocks) <= 0:
            raise ValueError(f"grid {self.name}: token, batch and block counts must be positive")

    def prefill_points(self) -> list[tuple[int, int]]:
        return [(n, p) for p in self.prefill_reused for n in self.prefill_new]

    def decode_points(self) -> list[tuple[int, int]]:
        return [(b, c) for b in self.decode_batch for c in self.decode_context]

    @property
    def max_tokens(self) -> int:
        """The longest prompt (new + reused) any prefill point needs."""
        points = self.prefill_points() + list(self.prefill_held_out)
        return max(n + p for n, p in points)


GRIDS = {
    "quick": CalibrationGrid(
        name="quick",
        prefill_new=(64, 512, 2048), prefill_reused=(0, 1024, 4096),
        prefill_held_out=((128, 256), (768, 256), (1024, 2048)), prefill_repeats=3,
        decode_batch=(1, 4, 16), decode_context=(64, 512, 2048),
        decode_held_out=((2, 256), (8, 1024)), decode_steps=3, decode_repeats=2,
        transfer_blocks=(1, 4, 16, 64), transfer_held_out=(8, 32), transfer_repeats=9,
    ),
    "full": CalibrationGrid(
        name="full",
        prefill_new=(32, 96, 256, 640, 1536), prefill_reused=(0, 256, 1024, 2048, 4096),
        prefill_held_out=((64, 512), (160, 1536), (448, 128), (1024, 3072), (48, 0), (320, 0), (800, 640)),
        prefill_repeats=3,
        decode_batch=(1, 2, 4, 8, 16, 32, 64), decode_context=(32, 256, 1024, 2048, 4096),
        decode_held_out=((3, 512), (12, 1536), (48, 128), (24, 3072), (6, 64)), decode_steps=5, decode_repeats=3,
        transfer_blocks=(1, 2, 4, 8, 16, 32, 64, 128, 256), transfer_held_out=(3, 12, 48, 192),
        transfer_repeats=11,
    ),
    "smoke": CalibrationGrid(
        name="smoke",
        prefill_new=(32, 64), prefill_reused=(0, 64),
        prefill_held_out=((48, 32),), prefill_repeats=1,
        decode_batch=(1, 2), decode_context=(32, 64),
        decode_held_out=((3, 48),), decode_steps=1, decode_repeats=1,
        transfer_blocks=(1, 4), transfer_held_out=(2,), transfer_repeats=1,
    ),
}
