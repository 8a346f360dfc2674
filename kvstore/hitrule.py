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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kvstore.blocks import Tier


@dataclasses.dataclass(frozen=True)
class SnapshotPolicy:
    """Where KDA snapshots are taken: after every ``interval_blocks``-th block, and after the
    last full block of each prompt."""

    interval_blocks: int

    def __post_init__(self) -> None:
        if self.interval_blocks <= 0:
            raise ValueError(f"interval_blocks must be positive, got {self.interval_blocks}")

    def snapshot_points(self, num_full_blocks: int) -> list[int]:
        """0-based indices of the blocks that carry a snapshot, ascending."""
        if num_full_blocks < 0:
            raise ValueError(f"num_full_blocks must be >= 0, got {num_full_blocks}")
        points = list(range(self.interval_blocks - 1, num_full_blocks, self.interval_blocks))
        if num_full_blocks and (not points or points[-1] != num_full_blocks - 1):
            points.append(num_full_blocks - 1)
        return points

    def is_snapshot_point(self, block_index: int, num_full_blocks: int) -> bool:
        """Whether block ``block_index`` of a prompt with ``num_full_blocks`` gets a snapshot."""
        if not 0 <= block_index < num_full_blocks:
            raise ValueError(f"block_index {block_index} outside [0, {num_full_blocks})")
        return (block_index + 1) % self.interval_blocks == 0 or block_index == num_full_blocks - 1


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


@dataclasses.dataclass(frozen=True)
class MatchResult:
    """A prefix match under the hybrid rule.

    ``num_blocks``: leading blocks usable (MLA rows present and a snapshot at block
    ``num_blocks - 1``). ``num_present_blocks``: leading blocks whose MLA rows are present
    (>= ``num_blocks``; the difference must be recomputed for lack of a snapshot).
    ``tiers``: the tier of each of the ``num_blocks`` usable blocks. ``holder``: the worker
    holding them when the match comes from a global index, None for a local store.
    """

    num_blocks: int
    num_present_blocks: int
    tiers: tuple[Tier, ...]
    holder: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.num_blocks <= self.num_present_blocks:
            raise ValueError(f"need 0 <= num_blocks ({self.num_blocks}) <= num_present ({self.num_present_blocks})")
        if len(self.tiers) != self.num_blocks:
            raise ValueError(f"{len(self.tiers)} tiers for {self.num_blocks} blocks")

    @property
    def snapshot_block(self) -> int | None:
        """Index of the block whose snapshot the match resumes from, None for no match."""
        return self.num_blocks - 1 if self.num_blocks else None


def match_blocks(tiers: Sequence[Tier | None], has_snapshot: Sequence[bool], holder: str | None = None) -> MatchResult:
    """Apply the hybrid rule to per-block tiers (None = absent) and snapshot flags."""
    num_blocks = usable_prefix(tiers, has_snapshot)
    usable_tiers = tuple(t for t in tiers[:num_blocks] if t is not None)
    return MatchResult(num_blocks, leading_present(tiers), usable_tiers, holder)
