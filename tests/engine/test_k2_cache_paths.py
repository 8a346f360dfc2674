"""The K2 architecture (tiny-k2) through every cache path: chunked prefill, absorbed decode with
RoPE on the paged latent cache, batching, and export/import at any block boundary (no KDA state,
so no snapshot is needed)."""

import dataclasses

import pytest
import torch

import engine
from engine.checkpoint import seeded_tensors
from engine.config import tiny_k2_config
from engine.model import HybridModel

PROMPT = [(i * 37 + 11) % 251 for i in range(150)]


@pytest.fixture(scope="module")
def k2():
    return engine.load_model("tiny-k2")


def decode_all(model, ids, block_size=16):
    cache = model.new_cache(num_pages=-(-len(ids) // block_size), num_slots=1, block_size=block_size)
    seq = cache.try_reserve("r", len(ids))
    return torch.cat([model.decode_step(cache, [seq], [t]) for t in ids])


def test_builtin_is_stateless_and_seeded(k2):
    assert k2.cfg.architecture == "deepseek_v3" and not k2.cfg.cache_layout.has_state
    assert k2.cfg.q_lora_rank is not None and k2.cfg.rope.yarn_factor == 32.0
    again = engine.load_model("tiny-k2")
    assert again.fingerprint == k2.fingerprint != engine.load_model("tiny").fingerprint
    assert engine.generate(again, PROMPT[:20], 5) == engine.generate(k2, PROMPT[:20], 5)


@pytest.mark.parametrize("chunk", [1, 7, 16, 64, 150])
def test_chunked_prefill_equals_absorbed_decode(k2, chunk):
    """Prefill expands the latents; decode attends in the latent space over paged rows whose rope
    keys were rotated when written. Both give the same logits at every position."""
    want = decode_all(k2, PROMPT)
    got = engine.prompt_logits(k2, PROMPT, chunk_tokens=chunk)
    assert (got - want).abs().max().item() < 2e-4
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()


def test_positions_matter(k2):
    """RoPE is applied: the same token run at another offset gives other logits (a NoPE model's
    MLA would only see the content)."""
    a = engine.prompt_logits(k2, PROMPT[:40])
    b = engine.prompt_logits(k2, [PROMPT[0]] * 8 + PROMPT[:40])[8:]
    assert (a - b).abs().max().item() > 1e-3


def test_export_at_any_boundary_continues_exactly(k2):
    bs, n = 16, 128
    cache = k2.new_cache(num_pages=32, num_slots=2, block_size=bs)
    whole = cache.try_reserve("whole", 200)
    k2.prefill(cache, whole, PROMPT[:n])  # no snapshot points asked for
    ref = k2.prefill(cache, whole, PROMPT[n:], all_logits=True)
    for at in (16, 64, 112):
        exp = engine.export_prefix(cache, whole, at)
        assert exp.mla.shape == (4, at, k2.cfg.latent_dim) and exp.kda_state.numel() == 0
        fresh = k2.new_cache(num_pages=32, num_slots=1, block_size=bs)
        resumed = fresh.try_reserve("resumed", 200)
        engine.import_prefix(fresh, resumed, exp)
        k2.prefill(fresh, resumed, PROMPT[at:n])
        got = k2.prefill(fresh, resumed, PROMPT[n:], all_logits=True)
        assert (got - ref).abs().max().item() < 1e-4


def test_batched_decode_equals_alone(k2):
    prompts = [PROMPT[:40], PROMPT[:97], PROMPT[5:21]]
    alone = [engine.generate(k2, p, 12) for p in prompts]
    cache = k2.new_cache(num_pages=64, num_slots=4, block_size=16)
    seqs = [cache.try_reserve(f"r{i}", len(p) + 12) for i, p in enumerate(prompts)]
    outs = [[int(k2.prefill(cache, s, p)[0].argmax())] for s, p in zip(seqs, prompts, strict=True)]
    for _ in range(11):
        logits = k2.decode_step(cache, seqs, [o[-1] for o in outs])
        for o, row in zip(outs, logits, strict=True):
            o.append(int(row.argmax()))
    assert outs == alone
    for s in seqs:
        cache.release(s)
    cache.check_integrity()


def test_moe_layer_freq_and_plain_query_run_consistently():
    cfg = dataclasses.replace(tiny_k2_config(), moe_layer_freq=2, q_lora_rank=None, name="freq2")
    model = HybridModel(cfg, seeded_tensors(cfg, 11), "freq2")
    assert [type(b.ffn).__name__ for b in model.blocks] == ["MLPWeights", "MLPWeights", "MoE", "MLPWeights"]
    want = decode_all(model, PROMPT[:50])
    assert (engine.prompt_logits(model, PROMPT[:50], chunk_tokens=16) - want).abs().max().item() < 2e-4
