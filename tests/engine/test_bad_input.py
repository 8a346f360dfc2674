"""Bad input: clear errors naming the field or tensor, nothing half-loaded."""

import json

import pytest
import torch

import engine
from engine.checkpoint import CheckpointError, save_checkpoint, seeded_tensors
from engine.config import tiny_config


def test_token_outside_vocab(tiny):
    with pytest.raises(ValueError, match=r"token id 9000 outside the vocabulary \[0, 8192\)"):
        engine.prompt_logits(tiny, [1, 2, 9000])
    with pytest.raises(ValueError, match="token id -1"):
        engine.generate(tiny, [-1], 3)


def test_prompt_too_long(tiny):
    with pytest.raises(ValueError, match="exceeds the model's maximum sequence length 8192"):
        engine.generate(tiny, [1] * 8190, 5)
    with pytest.raises(ValueError, match="must not be empty"):
        engine.prompt_logits(tiny, [])


def test_bad_sampling_values(tiny):
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        engine.generate(tiny, [1, 2], 3, temperature=1.0, top_p=1.5)
    with pytest.raises(ValueError, match="temperature"):
        engine.generate(tiny, [1, 2], 3, temperature=-1.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate(tiny, [1, 2], 0)


@pytest.fixture
def ckpt(tmp_path):
    cfg = tiny_config()
    tensors = seeded_tensors(cfg, 3)
    return tmp_path, cfg, tensors


def test_missing_tensor(ckpt):
    d, cfg, t = ckpt
    del t["model.layers.2.self_attn.kv_b_proj.weight"]
    save_checkpoint(d, cfg, t)
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.2\.self_attn\.kv_b_proj\.weight"):
        engine.load_model(str(d))


def test_unexpected_tensor(ckpt):
    d, cfg, t = ckpt
    t["model.layers.0.extra.weight"] = torch.zeros(3)
    save_checkpoint(d, cfg, t)
    with pytest.raises(CheckpointError, match=r"unexpected tensor model\.layers\.0\.extra\.weight"):
        engine.load_model(str(d))


def test_wrong_shape_names_both_shapes(ckpt):
    d, cfg, t = ckpt
    t["model.layers.1.self_attn.q_proj.weight"] = torch.zeros(128, 256)
    save_checkpoint(d, cfg, t)
    with pytest.raises(CheckpointError, match=r"q_proj\.weight has shape \[128, 256\], config expects \[256, 256\]"):
        engine.load_model(str(d))


def test_malformed_files(ckpt):
    d, cfg, t = ckpt
    save_checkpoint(d, cfg, t)
    (d / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="cannot read safetensors"):
        engine.load_model(str(d))
    (d / "config.json").write_text("{broken")
    with pytest.raises(ValueError, match="not valid JSON"):
        engine.load_model(str(d))
    raw = cfg.to_dict()
    del raw["linear_attn_config"]["kda_layers"]
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="missing required key linear_attn_config.kda_layers"):
        engine.load_model(str(d))
    with pytest.raises(CheckpointError, match="neither 'tiny' nor a directory"):
        engine.load_model(str(d / "nope"))


def test_sharded_roundtrip_equals_seeded(ckpt, tiny):
    d, cfg, t = ckpt
    save_checkpoint(d, cfg, t, num_shards=4)
    assert (d / "model.safetensors.index.json").exists()
    m = engine.load_model(str(d))
    assert m.fingerprint != tiny.fingerprint  # other weights, other fingerprint
    assert engine.load_model("tiny").fingerprint == tiny.fingerprint


def test_cache_pool_exhaustion_returns_none(tiny):
    cache = tiny.new_cache(num_pages=4, num_slots=1, block_size=16)
    assert cache.try_reserve("a", 100) is None  # needs 7 pages
    a = cache.try_reserve("a", 64)
    assert a is not None and cache.try_reserve("b", 16) is None  # no slot and no page left
    assert not cache.try_extend(a, 65)
    cache.release(a)
    cache.check_integrity()
    assert cache.pool.num_free == 4 and cache.slots.num_free == 1


def test_checkpoint_with_tokenizer_json(ckpt):
    """A checkpoint directory's tokenizer.json is used through the tokenizers package."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    d, cfg, t = ckpt
    save_checkpoint(d, cfg, t)
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    m = engine.load_model(str(d))
    assert m.tokenizer.encode("hello world nope") == [1, 2, 0]
    assert m.tokenizer.decode([1, 2]) == "hello world"
