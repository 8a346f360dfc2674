"""A decode worker's jobs as this Conductor knows them (``DecodeJobs``), searchable by when
each leaves or joins the running batch (``BatchIndex``).

The mooncake policy predicts every decode worker's batch at a future moment, for every
decision: which running jobs will still be generating then, which jobs in prefill will
have joined. A worker's jobs change far less often than decisions are made (the pending
overlay freezes a new tuple only when one of them moved), so the jobs are sorted once per
tuple, by remaining tokens and by join time, with running sums of their context tokens;
each prediction is then two binary searches instead of passes over every job. The counts
and sums are integers, and each search evaluates the policy's own comparison on the sorted
values (monotone in them), so the answers are exactly those of a pass over the jobs::

    running jobs by remaining tokens (ascending)   r0 <= r1 <= ... <= r(k-1)
    their leave times at step_s                    r0 * step_s <= ... (made once per step time)
    staying at at_s: those with r * step_s > at_s  = rj .. r(k-1), the first j by bisection
    their tokens                                   = tokens_from[j]

Pure values; nothing here is shared or locked.
"""

from __future__ import annotations

import functools
import itertools
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

from conductor.routing import DecodeJob


@dataclass(frozen=True)
class BatchIndex:
    """A decode worker's known jobs, sorted: the running ones by remaining tokens, the ones in
    prefill by predicted join time, each with its context tokens summed (see the module
    docstring)."""

    num_running: int  # known jobs in the running batch
    running_tokens: int  # their context tokens
    remaining: tuple[int, ...]  # running jobs' remaining tokens, ascending
    tokens_from: tuple[int, ...]  # [i]: tokens of the running jobs remaining[i:] (one entry more)
    ready_at_s: tuple[float, ...]  # jobs in prefill: predicted join moments, ascending
    tokens_before: tuple[int, ...]  # [i]: tokens of the jobs ready_at_s[:i] (one entry more)

    @classmethod
    def of(cls, jobs: Sequence[DecodeJob]) -> BatchIndex:
        running = sorted((j.num_remaining_tokens, j.num_tokens) for j in jobs if j.decoding)
        joining = sorted((j.ready_at_s, j.num_tokens) for j in jobs if not j.decoding)
        tokens_from = (*itertools.accumulate((t for _, t in reversed(running)), initial=0),)[::-1]
        return cls(len(running), tokens_from[0], tuple(r for r, _ in running), tokens_from,
                   tuple(a for a, _ in joining), (*itertools.accumulate((t for _, t in joining), initial=0),))

    def staying(self, step_s: float, at_s: float) -> tuple[int, int]:
        """Running jobs (and their tokens) that have not generated their remaining tokens
        ``at_s`` seconds from now at ``step_s`` a token: ``remaining * step_s > at_s``, which
        rises with ``remaining`` for ``step_s >= 0`` (the cost models' coefficients are)."""
        return self.staying_at(self.leave_times(step_s), at_s)

    def leave_times(self, step_s: float) -> tuple[float, ...]:
        """The running jobs' ``remaining * step_s``, ascending (``step_s >= 0``): what
        ``staying`` compares, made once for a step time that many predictions share (the
        policy keeps it per decode view)."""
        assert step_s >= 0, step_s
        return tuple([r * step_s for r in self.remaining])

    def staying_at(self, leave_times: tuple[float, ...], at_s: float) -> tuple[int, int]:
        """``staying(step_s, at_s)`` given ``leave_times(step_s)``: the first leave time past
        ``at_s`` by bisection."""
        first = bisect_right(leave_times, at_s)
        return self.num_running - first, self.tokens_from[first]

    def joining(self, now_s: float, until_s: float) -> tuple[int, int]:
        """Jobs in prefill (and their tokens) that join within ``until_s`` seconds of
        ``now_s``: ``DecodeJob.ready_in_s(now_s) <= until_s``, which rises with the join
        moment. A bisection by ``now_s + until_s`` guesses the count (the sum may round), and
        that test, evaluated at the guess, settles it."""
        ready = self.ready_at_s
        if not ready:
            return 0, 0
        num = bisect_right(ready, now_s + until_s)
        while num < len(ready) and max(1e-6, ready[num] - now_s) <= until_s:
            num += 1
        while num and max(1e-6, ready[num - 1] - now_s) > until_s:
            num -= 1
        return num, self.tokens_before[num]


class DecodeJobs(tuple):
    """A tuple of ``DecodeJob`` that keeps its ``BatchIndex``, made on first use (the tuple is
    immutable, so the index stays true for as long as the tuple lives)."""

    @functools.cached_property
    def batch_index(self) -> BatchIndex:
        return BatchIndex.of(self)


def batch_index(jobs: Sequence[DecodeJob]) -> BatchIndex:
    """The index of ``jobs``: kept with a ``DecodeJobs``, made anew for any other sequence."""
    return jobs.batch_index if isinstance(jobs, DecodeJobs) else BatchIndex.of(jobs)
