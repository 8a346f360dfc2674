"""The Conductor's refusals of a prompt or a max_tokens say the numbers that decide them: the
prompt's length, the limit and which limit it is (the Conductor's cap or the model's context),
each message led by its field once (a front renames the field: "prompt: 9000 tokens, ...")."""

import pytest

import engine
from conductor.validation import Limits, validate
from proto import inference_pb2 as pb

CFG, TOKENIZER = engine.load_config("tiny"), engine.load_tokenizer("tiny")
CAPPED = Limits(max_prompt_tokens=8000)


def check(num_prompt_tokens: int, max_tokens: int, limits: Limits = CAPPED):
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * num_prompt_tokens),
                             sampling=pb.SamplingParams(max_tokens=max_tokens))
    return validate(req, CFG, TOKENIZER, limits)


def test_max_tokens_past_the_context_names_the_prompt_length_and_the_context():
    assert CFG.max_seq_len == 8192
    assert len(check(7990, 202).prompt_ids) == 7990  # 7,990 + 202 = the whole context
    with pytest.raises(ValueError) as e:
        check(7990, 500)
    assert str(e.value) == ("sampling.max_tokens must be in [1, 202] (the prompt's 7990 tokens leave 202 of the "
                            "model's context of 8192), got 500")
    with pytest.raises(ValueError, match=r"must be in \[1, 4096\] \(max_new_tokens\), got 5000"):
        check(10, 5000)


def test_a_long_prompt_names_its_length_and_which_limit():
    with pytest.raises(ValueError) as e:
        check(9000, 1)
    assert str(e.value) == ("token_ids: 9000 tokens, the limit is 8000 (max_prompt_tokens; the model's context "
                            "is 8192 tokens)")
    assert str(e.value).count("prompt") == 1
    with pytest.raises(ValueError) as e:  # without a cap below it, the context is the limit
        check(8192, 1, Limits(max_prompt_tokens=100_000))
    assert str(e.value) == ("token_ids: 8192 tokens, the limit is 8191 (the model's context of 8192 tokens, less "
                            "one to generate)")
    with pytest.raises(ValueError, match="text: 9000 tokens, the limit is 8000"):
        validate(pb.GenerateRequest(text="a" * 9000, sampling=pb.SamplingParams(max_tokens=1)), CFG, TOKENIZER,
                 Limits(max_prompt_tokens=8000))
    with pytest.raises(ValueError, match="^token_ids: empty, give at least one token$"):
        check(0, 1)


def test_a_resume_may_cover_every_token_but_no_more():
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 10), sampling=pb.SamplingParams(max_tokens=4),
                             resume=pb.TokenIds(ids=[5, 6, 7, 8]))
    assert validate(req, CFG, TOKENIZER, CAPPED).resumed == (5, 6, 7, 8)  # only the finish was lost
    req.resume.ids.append(9)
    with pytest.raises(ValueError, match=r"^resume: 5 tokens were sent already, more than sampling.max_tokens 4$"):
        validate(req, CFG, TOKENIZER, CAPPED)
