"""Warm-up runs on a scratch cache: it leaves the results of later requests unchanged."""

import engine
from engine.warmup import warm_up


def test_warm_up_changes_no_answer():
    model = engine.load_model("tiny")
    ids = list(range(3, 70))
    before = engine.generate(model, ids, 6)
    assert warm_up(model, block_size=16, prefill_tokens=(16, 40), batch_sizes=(1, 2)) > 0
    assert engine.generate(model, ids, 6) == before
