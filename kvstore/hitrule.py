"""KDA snapshot placement and the hybrid hit rule, as pure functions.

A hybrid model can resume a prompt at block boundary i (after blocks [0, i)) only when the
MLA rows of every block before i are cached *and* the KDA recurrent state at that boundary
is cached, i.e. block i-1 carries a snapshot. Snapshots are large, so they are taken sparsely
(``SnapshotPolicy``), and a match is the deepest boundary satisfying both conditions::

    block index      0    1    2    3    4    5
    MLA present      y    y    y    y    n    y
    snapshot         .    y    .    y    .    y
    boundary         1    2    3    4    5    6
    usable prefix = 4 blocks (boundary 4: blocks 0..3 present, block 3 has a snapshot);
    block 5's snapshot is unreachable because block 4 is missing.

What a model carries follows its declared cache layout (``engine.CacheLayout``), never its
name. A model without state layers (all attention, such as DeepSeek-V3/K2) has an empty state:
its snapshot costs nothing, so ``SnapshotPolicy(..., has_state=False)`` keeps one at every
block, every block is resumable and the rule above reduces to "every present block"::

    block index      0    1    2    3    4    5
    MLA present      y    y    y    y    n    y
    snapshot         y    y    y    y    .    y     (empty: no state layers)
    usable prefix = 4 blocks, the leading run of present blocks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kvstore.blocks import Tier


@dataclasses.dataclass(frozen=True)
class SnapshotPolicy:
    """Where KDA snapshots are taken: after every ``interval_blocks``-th block, and after the
    last full block of each prompt. ``has_state``: whether the model's cache layout has state
    layers at all; without them the (empty) snapshot is kept at every block."""

    interval_blocks: int
    has_state: bool = True

    def __post_init__(self) -> None:
        if self.interval_blocks <= 0:
            raise ValueError(f"interval_blocks must be positive, got {self.interval_blocks}")

    @property
    def every_block(self) -> int:
        """The spacing actually used: 1 (every block) for a model without state layers."""
        return self.interval_blocks if self.has_state else 1

    def snapshot_points(self, num_full_blocks: int) -> list[int]:
        """0-based indices of the blocks that carry a snapshot, ascending."""
        if num_full_blocks < 0:
            raise ValueError(f"num_full_blocks must be >= 0, got {num_full_blocks}")
        points = list(range(self.every_block - 1, num_full_blocks, self.every_block))
        if num_full_blocks and (not points or points[-1] != num_full_blocks - 1):
            points.append(num_full_blocks - 1)
        return points

    def is_snapshot_point(self, block_index: int, num_full_blocks: int) -> bool:
        """Whether block ``block_index`` of a prompt with ``num_full_blocks`` gets a snapshot."""
        if not 0 <= block_index < num_full_blocks:
            raise ValueError(f"block_index {block_index} outside [0, {num_full_blocks})")
        return (block_index + 1) % self.every_block == 0 or block_index == num_full_blocks - 1


def _is_present(entry: bool | Tier | None) -> bool:
    # Tier.DEVICE == 0 is falsy, so presence is "not None and not False", never truthiness.
    return entry is not None and entry is not False


def usable_length(resumable: Sequence[bool] | bytes) -> int:
    """The hybrid rule over a run of blocks that are all present: the number of leading
    blocks reusable, i.e. one past the deepest block at whose end the model can resume (it
    carries a KDA snapshot). ``resumable`` may be bools, or ``bytes`` of 0/1 flags (the
    indexes' fast path: one C call over a whole match)."""
    if isinstance(resumable, bytes | bytearray):
        return resumable.rfind(1) + 1
    for i in range(len(resumable) - 1, -1, -1):
        if resumable[i]:
            return i + 1
    return 0


def usable_prefix(present: Sequence[bool | Tier | None], has_snapshot: Sequence[bool]) -> int:
    """Number of leading blocks reusable under the hybrid rule (see the module docstring).

    ``present[i]``: whether block i's MLA rows are cached (a bool, or its ``Tier`` / None).
    ``has_snapshot[i]``: whether a KDA snapshot at block i's end is cached.
    """
    if len(present) != len(has_snapshot):
        raise ValueError(f"present has {len(present)} entries but has_snapshot has {len(has_snapshot)}")
    return usable_length(has_snapshot[: leading_present(present)])


def leading_present(present: Sequence[bool | Tier | None]) -> int:
    """Number of leading blocks whose MLA rows are cached, snapshots aside."""
    for i, entry in enumerate(present):
        if not _is_present(entry):
            return i
    return len(present)
