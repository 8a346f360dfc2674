"""Chunked prefill, decode, batching, export/import: every path gives the same numbers."""

import pytest
import torch

import engine
from engine.sampler import SamplingParams, sample

PROMPT = [(i * 37 + 11) % 251 for i in range(150)]


def decode_all(model, ids):
    """Token-by-token: feeds every prompt token through decode_step; returns logits [N, V]."""
    cache = model.new_cache(num_pages=16, num_slots=1, block_size=16)
    seq = cache.try_reserve("r", len(ids))
    return torch.cat([model.decode_step(cache, [seq], [t]) for t in ids])


@pytest.mark.parametrize("chunk", [1, 7, 16, 64, 150, 1000])
def test_chunked_prefill_equals_token_by_token(tiny, chunk):
    want = decode_all(tiny, PROMPT)
    got = engine.prompt_logits(tiny, PROMPT, chunk_tokens=chunk)
    assert (got - want).abs().max().item() < 2e-4
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()


@pytest.mark.parametrize("decay", [3.0, 60.0], ids=["mild", "strong"])
def test_kda_chunk_sizes_agree(tiny, decay):
    """Chunked forms equal the token-by-token one (chunk 1), also where decays are strong
    enough that most pairwise exponents fall below the clamp (``EXP_FLOOR``)."""
    from engine.kda import chunked_delta_rule

    g = torch.Generator().manual_seed(0)
    t, h, d = 77, 2, 16
    q, k, v = (torch.nn.functional.normalize(torch.randn(t, h, d, generator=g), dim=-1) for _ in range(3))
    gate = -torch.rand(t, h, d, generator=g) * decay
    beta = torch.rand(t, h, generator=g)
    s0 = torch.randn(h, d, d, generator=g)
    outs = [chunked_delta_rule(q, k, v, gate, beta, s0, c) for c in (1, 5, 16, 128)]
    for o, s in outs[1:]:
        assert torch.allclose(o, outs[0][0], atol=1e-4) and torch.allclose(s, outs[0][1], atol=1e-4)


def test_export_import_continues_exactly(tiny):
    bs, n = 16, 128
    cache = tiny.new_cache(num_pages=32, num_slots=2, block_size=bs)
    whole = cache.try_reserve("whole", 200)
    tiny.prefill(cache, whole, PROMPT[:n], snapshot_at=[64])
    ref = tiny.prefill(cache, whole, PROMPT[n:], all_logits=True)
    exp = engine.export_prefix(cache, whole, 64)  # from the snapshot, not the current state
    assert exp.mla.shape == (2, 64, tiny.cfg.latent_dim)
    fresh_cache = tiny.new_cache(num_pages=32, num_slots=1, block_size=bs)
    resumed = fresh_cache.try_reserve("resumed", 200)
    engine.import_prefix(fresh_cache, resumed, exp)
    tiny.prefill(fresh_cache, resumed, PROMPT[64:n])
    got = tiny.prefill(fresh_cache, resumed, PROMPT[n:], all_logits=True)
    assert (got - ref).abs().max().item() < 1e-4
    # Continue decoding both: identical tokens.
    toks = []
    for c, s in ((cache, whole), (fresh_cache, resumed)):
        t = [int(ref[-1].argmax())]
        for _ in range(8):
            t.append(int(tiny.decode_step(c, [s], [t[-1]])[0].argmax()))
        toks.append(t)
    assert toks[0] == toks[1]


def test_export_needs_state_at_boundary(tiny):
    cache = tiny.new_cache(num_pages=16, num_slots=1, block_size=16)
    seq = cache.try_reserve("r", 64)
    tiny.prefill(cache, seq, PROMPT[:64])
    with pytest.raises(ValueError, match="no KDA state at token 32"):
        engine.export_prefix(cache, seq, 32)
    with pytest.raises(ValueError, match="multiple of block_size"):
        engine.export_prefix(cache, seq, 40)


def test_batched_decode_equals_alone(tiny):
    prompts = [PROMPT[:40], PROMPT[:97], PROMPT[5:21]]
    alone = [engine.generate(tiny, p, 12) for p in prompts]
    cache = tiny.new_cache(num_pages=64, num_slots=4, block_size=16)
    seqs = [cache.try_reserve(f"r{i}", len(p) + 12) for i, p in enumerate(prompts)]
    last = [int(tiny.prefill(cache, s, p)[0].argmax()) for s, p in zip(seqs, prompts, strict=True)]
    outs = [[t] for t in last]
    for _ in range(11):
        logits = tiny.decode_step(cache, seqs, [o[-1] for o in outs])
        for o, row in zip(outs, logits, strict=True):
            o.append(int(row.argmax()))
    assert outs == alone
    for s in seqs:
        cache.release(s)
    cache.check_integrity()
    assert cache.pool.num_free == 64


def test_seeded_sampling_alone_and_batched(tiny):
    params = SamplingParams(max_new_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=1234)
    alone = engine.generate(tiny, PROMPT[:50], 10, temperature=0.9, top_p=0.9, top_k=50, seed=1234)
    assert alone == engine.generate(tiny, PROMPT[:50], 10, temperature=0.9, top_p=0.9, top_k=50, seed=1234)
    assert alone != engine.generate(tiny, PROMPT[:50], 10, temperature=0.9, top_p=0.9, top_k=50, seed=99)
    other = SamplingParams(max_new_tokens=10, temperature=1.3, seed=5)
    cache = tiny.new_cache(num_pages=32, num_slots=2, block_size=16)
    a, b = cache.try_reserve("a", 60), cache.try_reserve("b", 60)
    la = tiny.prefill(cache, a, PROMPT[:50])
    lb = tiny.prefill(cache, b, PROMPT[60:80])
    toks = sample(torch.cat([la, lb]), [params, other], [50, 20])
    outs = [[toks[0]], [toks[1]]]
    for _ in range(9):
        logits = tiny.decode_step(cache, [a, b], [outs[0][-1], outs[1][-1]])
        nxt = sample(logits, [params, other], [a.num_tokens, b.num_tokens])
        outs[0].append(nxt[0])
        outs[1].append(nxt[1])
    assert outs[0] == alone


def test_stop_token_ends_generation(tiny):
    full = engine.generate(tiny, PROMPT[:30], 10)
    stop = full[3]
    cut = engine.generate(tiny, PROMPT[:30], 10, stop_token_ids=[stop])
    assert cut == full[: full.index(stop) + 1]
