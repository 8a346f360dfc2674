"""The snapshot's ViewMemo: a snapshot built from the last one (the workers whose inputs
changed remade, the busy ones timed) equals one built from scratch, through hand-made and
random histories, and falls back to every worker when it cannot know what changed."""

from __future__ import annotations

import random

from clusterstate.workers import PrefillJobLoad, WorkerLoad, WorkerRole
from conductor.dispatch import request_of
from conductor.pending import PendingView, PendingWork
from conductor.routing import ReusePlan, RouteDecision, RouteRequest
from conductor.snapshot import RegistryEntry, ViewMemo, build_snapshot
from conductor.speed import Pace, Paces
from conductor.worker_views import jobs_template
from kvstore.blocks import Tier
from kvstore.index import MatchSnapshot, WorkerMatch
from tests.conductor.test_core import BS, entry


def test_a_view_memo_changes_no_snapshot() -> None:
    """Snapshots built with a ViewMemo equal those built without, through routes, progress,
    ends, a new heartbeat and an aging one; unchanged workers get their last view back."""
    pending, memo = PendingWork(), ViewMemo()
    load_p = WorkerLoad(prefill_jobs=(PrefillJobLoad("x", 68, 32, 0.25),))
    registry = [entry("p0", "prefill", load_p), entry("p1", "prefill"), entry("d0", "decode"), entry("d1", "decode")]

    def both(now_s: float, age_s: float = 0.0):
        registry[0] = RegistryEntry(registry[0].info, registry[0].load, age_s)
        paces = {"p1": Pace(1.5, 0.01, 0.002)}  # made anew per decision, as the Conductor's are
        view = pending.view()
        plain = build_snapshot(registry, None, view, now_s, 0.0, paces)
        memoised = build_snapshot(registry, None, view, now_s, 0.0, paces, memo)
        assert memoised == plain
        return memoised

    first = both(0.0)
    assert both(0.0).decode[1] is first.decode[1] and both(0.0).prefill[1] is first.prefill[1]
    for i in range(3):
        req = RouteRequest(f"r{i}", i, 100, 6, 20, BS)
        pending.route(req, RouteDecision(f"p{i % 2}", f"d{i % 2}", ReusePlan(2, None)), 0.1 * i)
        both(0.1 * i, age_s=0.1 * i)
    pending.prefill_done("r0", 0.5)
    pending.decode_started("r0", 0.5)
    both(0.5, age_s=0.5)
    pending.generated("r0", 4)
    both(0.6, age_s=0.5)
    pending.finish("r1", 0.7)
    both(0.7, age_s=0.7)
    registry[2] = entry("d0", "decode", WorkerLoad(num_free_pages=900, num_running=1, num_context_tokens=104,
                                                   request_ids=("r0",)))
    after = both(0.8, age_s=0.8)
    assert after.decode[0].num_free_pages != first.decode[0].num_free_pages


def test_a_view_memo_changes_no_snapshot_through_random_histories() -> None:
    """The memo's update of the last snapshot (only the workers whose inputs changed, and the
    timed ones timed) equals a full build after every step of random histories: routes and
    their progress, new heartbeats (running jobs, listed requests), new paces (a ``Paces``
    that grows, as ``WorkerSpeed``'s does), matches, a worker joining and leaving, a pending
    view that skipped one."""
    rng = random.Random(11)
    for _ in range(20):
        pending, memo, paces = PendingWork(finished_ttl_s=0.3), ViewMemo(), Paces()
        registry = [entry(f"p{i}", "prefill") for i in range(4)] + [entry(f"d{i}", "decode") for i in range(3)]
        live: list[str] = []
        now_s = 0.0
        for step in range(60):
            now_s += rng.choice([0.0, 0.01, 0.05, 0.2])
            op = rng.random()
            if op < 0.3:
                rid = f"r{step}"
                req = RouteRequest(rid, step, rng.randint(100, 200), 6, 20, BS)
                reuse = ReusePlan(rng.randint(0, 2), None)
                decision = RouteDecision(f"p{rng.randrange(4)}", f"d{rng.randrange(3)}", reuse)
                pending.route(req, decision, now_s)
                live.append(rid)
            elif op < 0.5 and live:
                rid = rng.choice(live)
                getattr(pending, rng.choice(["prefill_done", "decode_started"]))(rid, now_s)
                pending.generated(rid, rng.randint(1, 10))
            elif op < 0.6 and live:
                pending.finish(live.pop(rng.randrange(len(live))), now_s)
            elif op < 0.75:
                i = rng.randrange(len(registry))
                e = registry[i]
                if e.role is WorkerRole.PREFILL:
                    listed = rng.sample(live, min(2, len(live)))
                    jobs = tuple(PrefillJobLoad(rid, 50, 0, rng.choice([0.0, 0.02])) for rid in listed)
                    load = WorkerLoad(num_free_pages=1000, prefill_jobs=jobs, timestamp_s=now_s)
                else:
                    load = WorkerLoad(num_free_pages=rng.randint(500, 1000), num_running=rng.randint(0, 2),
                                      request_ids=tuple(rng.sample(live, min(2, len(live)))), timestamp_s=now_s)
                registry[i] = RegistryEntry(e.info, load, 0.0)
            elif op < 0.85:
                worker = f"p{rng.randrange(4)}"
                paces = Paces({**paces, worker: Pace(rng.uniform(0.8, 1.5), 0.01, 0.002)})
            elif op < 0.9:
                if len(registry) == 7:
                    registry.insert(4, entry("p9", "prefill"))
                else:
                    del registry[4]
            # every load ages with the clock; the registry is handed out anew or as it was
            registry = [RegistryEntry(e.info, e.load, max(0.0, now_s - e.load.timestamp_s)) if e.load.prefill_jobs
                        else e for e in registry]
            matches = MatchSnapshot(6, tuple(WorkerMatch(f"p{i}", 6, rng.choice([0, 0, 2, 5]), (Tier.DRAM,) * 6)
                                             for i in range(4)))
            if rng.random() < 0.05:
                pending.view()  # a view the memo did not see: it must look at every worker
            view = pending.view()
            plain = build_snapshot(tuple(registry), matches, view, now_s, 0.0, paces)
            assert build_snapshot(tuple(registry), matches, view, now_s, 0.0, paces, memo) == plain, step


def test_a_view_memo_fed_another_overlay_s_next_view_looks_at_every_worker() -> None:
    """A view numbered next by another overlay says nothing of what changed since the memo's
    last one: the memo must not start from the last snapshot's views."""
    registry = [entry("p0", "prefill"), entry("d0", "decode")]
    mine, other, memo, paces = PendingWork(), PendingWork(), ViewMemo(), {"p0": Pace()}
    first = build_snapshot(registry, None, mine.view(), 0.0, 0.0, paces, memo)
    other.route(RouteRequest("r0", 0, 100, 6, 20, BS), RouteDecision("p0", "d0", ReusePlan(0, None)), 0.0)
    other.view()
    later = other.view()  # serial 2, as mine's next would be, and nothing changed since its serial 1
    assert later.serial == 2 and later.changed == frozenset()
    memoised = build_snapshot(registry, None, later, 0.1, 0.0, paces, memo)
    assert memoised == build_snapshot(registry, None, later, 0.1, 0.0, paces) != first
    assert [j.request_id for j in memoised.prefill[0].prefill_jobs] == ["r0"]


def _plain_template_parts(load: WorkerLoad, view: PendingView, worker_id: str) -> tuple:
    """``jobs_template``'s jobs, listed running jobs and whether another job runs, by their
    definitions, one job at a time."""
    own = view.prefill_jobs.get(worker_id, ())
    if not load.prefill_jobs:
        jobs, aged = own, ()
    else:
        left = view.left_prefill.get(worker_id, frozenset())
        kept = [j for j in load.prefill_jobs if request_of(j.request_id) not in left]
        aged = tuple(i for i, j in enumerate(kept) if j.elapsed_s != 0)
        listed = {request_of(j.request_id) for j in load.prefill_jobs}
        jobs = tuple(kept + [j for j in own if j.request_id not in listed])
    return jobs, aged, any(j.elapsed_s > 0 for i, j in enumerate(jobs) if i not in aged)


def test_a_jobs_template_is_its_definition_on_random_heartbeats_and_overlays() -> None:
    """A prefill worker's jobs template (what the heartbeat lists, less what left, then this
    Conductor's jobs it does not list; the listed running ones; whether one of ours runs) on
    random heartbeats (placement ids, running and queued jobs) and overlays (jobs that left,
    our own jobs, some running)."""
    rng = random.Random(5)
    for _ in range(500):
        ids = [f"r{i}" for i in range(rng.randint(0, 8))]
        listed = rng.sample(ids, rng.randint(0, len(ids)))
        jobs = tuple(PrefillJobLoad(f"{r}/{rng.randint(0, 2)}" if rng.random() < 0.5 else r, rng.randint(1, 99), 0,
                                    rng.choice([0.0, 0.0, 0.05])) for r in listed)
        own = tuple(PrefillJobLoad(r, rng.randint(1, 99), 0, rng.choice([0.0, 0.0, 0.03]))
                    for r in rng.sample(ids, rng.randint(0, len(ids))))
        view = PendingView(prefill_jobs={"p0": own} if own else {},
                           left_prefill={"p0": frozenset(rng.sample(ids, rng.randint(0, len(ids))))}
                           if rng.random() < 0.7 else {})
        load = WorkerLoad(prefill_jobs=jobs)
        template = jobs_template(entry("p0", "prefill", load), view)
        assert (template.jobs, template.aged, template.others_run) == _plain_template_parts(load, view, "p0")
