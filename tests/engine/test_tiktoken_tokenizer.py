"""Kimi's tokenizer files (``tiktoken.model`` + ``tokenizer_config.json``) through tiktoken, with a
rank file trained here on a small corpus (no downloadable encoding is ever asked for)."""

from __future__ import annotations

import json
import shutil

import pytest

import engine
from engine.checkpoint import CheckpointError
from engine.config import tiny_config
from engine.detokenizer import Detokenizer
from engine.tiktoken_tokenizer import MAX_RUN_CHARS, TiktokenTokenizer
from openai_api.chat_template import load_chat_template
from tests.checkpoint_support import SPECIAL, train_ranks, write_tiktoken_tokenizer

RANKS = train_ranks()


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config().to_dict()))
    write_tiktoken_tokenizer(tmp_path, RANKS)
    return tmp_path


def test_round_trip_and_merges(model_dir):
    tok = engine.load_tokenizer(str(model_dir))
    assert isinstance(tok, TiktokenTokenizer)
    text = "The prefill worker streams 2048 keys. 缓存命中时，只算新的词元。 It's done!\n\n  ok"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode()) / 2  # the trained merges are used
    assert all(0 <= i < len(RANKS) for i in ids)


def test_kimi_split_pattern(model_dir):
    """Kimi's pattern, not GPT-2's: digits in threes, a case change starts a word, Han runs apart."""
    tok = engine.load_tokenizer(str(model_dir))
    assert tok.encode("12345") == tok.encode("123") + tok.encode("45")
    assert tok.encode("HelloWorld") == tok.encode("Hello") + tok.encode("World")
    assert tok.encode("缓存abc") == tok.encode("缓存") + tok.encode("abc")


def test_special_tokens(model_dir):
    tok = engine.load_tokenizer(str(model_dir))
    base = len(RANKS)
    assert tok.vocab_size == base + 256
    assert [tok.special[s] for s in SPECIAL] == list(range(base, base + len(SPECIAL)))
    assert tok.special[f"<|reserved_token_{base + 200}|>"] == base + 200
    assert tok.eos_token_id == tok.special["<|im_end|>"] and tok.bos_token_id == base
    ids = tok.encode("<|im_user|>user<|im_middle|>hi<|im_end|>")
    assert ids[0] == tok.special["<|im_user|>"] and ids[-1] == tok.eos_token_id
    assert tok.decode(ids) == "userhi"  # special tokens are not text
    assert tok.decode([base + 255, 9000, 104, 105]) == "hi"  # reserved and out-of-vocabulary ids drop


def test_long_runs_are_cut(model_dir):
    tok = engine.load_tokenizer(str(model_dir))
    run = "a" * (2 * MAX_RUN_CHARS + 10)
    ids = tok.encode("x " + run)
    chunks = ["x " + run[: MAX_RUN_CHARS - 1], run[MAX_RUN_CHARS - 1 : 2 * MAX_RUN_CHARS - 1],
              run[2 * MAX_RUN_CHARS - 1 :]]
    assert ids == [i for c in chunks for i in tok.encode(c)]
    assert tok.decode(ids) == "x " + run


def test_chat_template_and_streaming_detokenizer(model_dir):
    tok = engine.load_tokenizer(str(model_dir))
    template = load_chat_template(str(model_dir))
    text = template.render([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "缓存？"}])
    assert text.endswith("<|im_assistant|>assistant<|im_middle|>")
    ids = tok.encode(text)
    assert ids.count(tok.special["<|im_end|>"]) == 2 and ids[-1] == tok.special["<|im_middle|>"]
    reply = "预填充只计算新的词元, then 12 tokens."
    detok, out = Detokenizer(tok), []
    for i in tok.encode(reply) + [tok.eos_token_id]:  # one id at a time: a character's bytes may span ids
        out.append(detok.push([i]))
    assert "".join(out) + detok.flush() == reply
    assert any(o == "" for o in out)  # some step held back an incomplete character


def test_a_rewritten_rank_file_is_read_again(model_dir):
    """tiktoken caches rank files by path; the file's own hash keeps a stale copy from being used."""
    first = engine.load_tokenizer(str(model_dir))
    write_tiktoken_tokenizer(model_dir, train_ranks(num_merges=20))
    second = engine.load_tokenizer(str(model_dir))
    assert second.vocab_size == 256 + 20 + 256 != first.vocab_size


def test_a_checkpoint_loads_with_it(model_dir, tmp_path):
    from engine.checkpoint import save_checkpoint, seeded_tensors

    cfg = tiny_config()
    save_checkpoint(model_dir, cfg, seeded_tensors(cfg, 1))
    model = engine.load_model(str(model_dir))
    ids = model.tokenizer.encode("<|im_user|>user<|im_middle|>hello<|im_end|>")
    assert isinstance(model.tokenizer, TiktokenTokenizer)
    assert len(engine.generate(model, ids, 4)) == 4


def test_bad_tokenizer_files(model_dir):
    ranks_path, config_path = model_dir / "tiktoken.model", model_dir / "tokenizer_config.json"
    good_ranks, good_config = ranks_path.read_text(), json.loads(config_path.read_text())

    def fails(pattern: str) -> None:
        with pytest.raises(CheckpointError, match=pattern):
            engine.load_tokenizer(str(model_dir))
        ranks_path.write_text(good_ranks)
        config_path.write_text(json.dumps(good_config))

    ranks_path.write_text(good_ranks + "not-base64-and-no-rank\n")
    fails(r"tiktoken\.model: not a tiktoken BPE rank file")
    ranks_path.write_text(good_ranks.replace(" 300\n", " 9999\n"))
    fails(r"tiktoken\.model: ranks must be 0\.\.")
    config_path.write_text(json.dumps({**good_config, "added_tokens_decoder": {"5": {"content": "[X]"}}}))
    fails(r"tokenizer_config\.json: added token '\[X\]' has id 5, which is a BPE rank")
    config_path.write_text(json.dumps({**good_config, "eos_token": "</s>"}))
    fails(r"tokenizer_config\.json: eos_token '</s>' is not one of its special tokens")
    config_path.write_text("{not json")
    fails(r"tokenizer_config\.json: not valid JSON")
    small = {**tiny_config().to_dict(), "vocab_size": 600}
    (model_dir / "config.json").write_text(json.dumps(small))
    fails(r"tiktoken\.model: the tokenizer has 740 ids .* more than config\.json's vocab_size 600")


def test_tiktoken_model_wins_over_tokenizer_json(model_dir, tmp_path):
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]")).save(str(model_dir / "tokenizer.json"))
    assert isinstance(engine.load_tokenizer(str(model_dir)), TiktokenTokenizer)
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(model_dir / "config.json", other / "config.json")
    shutil.copy(model_dir / "tokenizer.json", other / "tokenizer.json")
    assert type(engine.load_tokenizer(str(other))).__name__ == "HFTokenizer"
