"""The built-in model's Hugging Face-style directory (engine.model_files): transformers loads it
offline, and its tokenizer is Tidekv's own: the same ids for any text, the same text for any
ids; a stale file is rewritten; a checkpoint directory is its own."""

from __future__ import annotations

import json
import random

import pytest

import engine
from engine.model_files import TINY_CHAT_TEMPLATE, model_files_dir
from engine.tokenizer import CharTokenizer

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return model_files_dir("tiny", tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def hf(files):
    return transformers.AutoTokenizer.from_pretrained(str(files), local_files_only=True)


def test_the_directory_has_what_peers_read(files):
    assert sorted(p.name for p in files.iterdir()) == ["config.json", "generation_config.json", "tokenizer.json",
                                                       "tokenizer_config.json"]
    cfg = engine.tiny_config()
    config = json.loads((files / "config.json").read_text())
    assert config["vocab_size"] == cfg.vocab_size and config["max_position_embeddings"] == cfg.max_seq_len
    assert json.loads((files / "tokenizer_config.json").read_text())["chat_template"] == TINY_CHAT_TEMPLATE
    assert json.loads((files / "generation_config.json").read_text())["eos_token_id"] == cfg.eos_token_id


def test_hf_tokenizer_matches_tidekv_on_any_ids_and_text(hf):
    tok = CharTokenizer(engine.tiny_config().vocab_size)
    assert (hf.bos_token_id, hf.eos_token_id) == (tok.BOS, tok.EOS) == (256, 257)
    rng = random.Random(7)
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 64))]
        text = tok.decode(ids)
        assert hf.decode(ids, skip_special_tokens=True) == text
        assert hf.encode(text, add_special_tokens=False) == tok.encode(text) == [i for i in ids if i not in (256, 257)]
    for text in ("hello world\n\tx", "héllo €uro 中文", "<|user|>hi\n<|assistant|>", "a<|tidekv:eos|>b", "\x00\x7f"):
        assert hf.encode(text, add_special_tokens=False) == tok.encode(text), text
    rendered = hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert rendered == "<|user|>hi\n<|assistant|>"


def test_stale_files_are_rewritten_and_a_checkpoint_is_its_own(files, tmp_path):
    (files / "tokenizer.json").write_text("{}")
    again = model_files_dir("tiny", files.parent.parent)
    assert again == files and json.loads((files / "tokenizer.json").read_text())["model"]["type"] == "WordLevel"
    assert model_files_dir(str(tmp_path)) == tmp_path.resolve()
