"""BatchIndex answers exactly what a pass over the jobs answers (the policy's comparisons on
the same floats), and a DecodeJobs tuple keeps its index."""

import random

from conductor.decode_batch import BatchIndex, DecodeJobs, batch_index
from conductor.routing import DecodeJob


def _jobs(rng: random.Random, num: int) -> tuple[DecodeJob, ...]:
    return tuple(DecodeJob(f"r{i}", rng.randint(1, 5000), rng.randint(0, 300), rng.random() < 0.6,
                           rng.choice([0.5, 1.0, 1.0 + 1e-9, rng.uniform(0.0, 3.0)])) for i in range(num))


def test_staying_and_joining_match_a_pass_over_the_jobs() -> None:
    rng = random.Random(7)
    for _ in range(300):
        jobs = _jobs(rng, rng.randint(0, 12))
        index = BatchIndex.of(jobs)
        running = [j for j in jobs if j.decoding]
        assert (index.num_running, index.running_tokens) == (len(running), sum(j.num_tokens for j in running))
        step_s, at_s = rng.choice([0.0, 0.02, 0.0205]), rng.choice([0.0, 0.5, rng.uniform(0, 8)])
        now_s = rng.choice([0.5, 0.1, rng.uniform(0, 2)])
        staying = [j for j in running if j.num_remaining_tokens * step_s > at_s]
        assert index.staying(step_s, at_s) == (len(staying), sum(j.num_tokens for j in staying))
        until_s = rng.choice([0.0, 0.5, 1e-6, rng.uniform(0, 3)])
        joining = [j for j in jobs if not j.decoding and j.ready_in_s(now_s) <= until_s]
        assert index.joining(now_s, until_s) == (len(joining), sum(j.num_tokens for j in joining))


def test_joining_counts_by_the_policy_s_test_where_the_sum_rounds() -> None:
    """0.1 + 0.2 rounds up to the join moment 0.30000000000000004, whose wait from 0.1 is
    0.20000000000000004: more than 0.2, so that job does not join within 0.2 s."""
    jobs = (DecodeJob("a", 10, 5, False, 0.1 + 0.2), DecodeJob("b", 20, 5, False, 0.25))
    assert jobs[0].ready_in_s(0.1) > 0.2
    assert BatchIndex.of(jobs).joining(0.1, 0.2) == (1, 20)
    assert BatchIndex.of(jobs).joining(0.1, 0.0) == (0, 0)


def test_a_decode_jobs_tuple_keeps_its_index() -> None:
    jobs = DecodeJobs(_jobs(random.Random(1), 5))
    assert batch_index(jobs) is batch_index(jobs)
    assert jobs == tuple(jobs) and batch_index(tuple(jobs)) == batch_index(jobs)
    assert batch_index(DecodeJobs()) == BatchIndex(0, 0, (), (0,), (), (0,))
