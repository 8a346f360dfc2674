"""The official ``openai`` client against the HTTP front on a live cluster: completions and chat,
streaming and not, token-exact with ``engine.generate``; prefix reuse reported as
``cached_tokens``; stop strings across token boundaries; stop token ids."""

from __future__ import annotations

import httpx
import openai
import pytest

import engine
from openai_api.chat_template import load_chat_template
from tests.e2e.helpers import prompt, wait_all_freed
from tests.openai_api.conftest import MODEL

SEEDED = dict(temperature=0.8, top_p=0.9, seed=17)
EOS = engine.load_tokenizer(MODEL).eos_token_id


@pytest.fixture(scope="module")
def client(front):
    c = openai.OpenAI(base_url=front.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield c
    c.close()


@pytest.fixture(scope="module")
def tok():
    return engine.load_tokenizer(MODEL)


def expected(reference, ids, max_tokens, **sampling):
    """The reference's tokens; the front stops at EOS by default, so the reference does too."""
    return engine.generate(reference, list(ids), max_tokens, stop_token_ids=(EOS,), **sampling)


def finish_of(want, max_tokens):
    return "stop" if want[-1] == EOS and len(want) <= max_tokens else "length"


def collect(stream):
    """(text, token_ids, finish_reason, usage, num_chunks) of a completions or chat stream."""
    text, ids, finish, usage, n = "", [], None, None, 0
    for chunk in stream:
        n += 1
        usage = chunk.usage or usage
        for choice in chunk.choices:
            delta = choice.delta.content if hasattr(choice, "delta") else choice.text
            text += delta or ""
            ids += choice.token_ids
            finish = choice.finish_reason or finish
    return text, ids, finish, usage, n


def test_models_health_ready(client, front):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].max_model_len == engine.load_config(MODEL).max_seq_len
    assert httpx.get(front.base_url + "/health").status_code == 200
    ready = httpx.get(front.base_url + "/ready")
    assert ready.status_code == 200 and ready.json()["conductor"] == "SERVING"


def test_completion_greedy_text_prompt(client, reference, tok):
    text = "Tidekv keeps finished blocks of KV cache. "
    out = client.completions.create(model=MODEL, prompt=text, max_tokens=16, temperature=0)
    want = expected(reference, tok.encode(text), 16)
    choice = out.choices[0]
    assert choice.token_ids == want
    assert choice.text == tok.decode(want)
    assert choice.finish_reason == finish_of(want, 16)
    assert out.usage.prompt_tokens == len(tok.encode(text)) and out.usage.completion_tokens == len(want)
    assert out.object == "text_completion" and out.model == MODEL


def test_completion_stream_seeded_token_prompt(client, reference, tok):
    ids = prompt(70, 1)
    stream = client.completions.create(model=MODEL, prompt=ids, max_tokens=20, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"top_k": 40}, **SEEDED)
    text, got, finish, usage, n = collect(stream)
    want = expected(reference, ids, 20, top_k=40, **SEEDED)
    assert got == want and text == tok.decode(want)
    assert finish == finish_of(want, 20) and n >= 3
    assert usage.prompt_tokens == 70 and usage.completion_tokens == len(want)


def chat_ids(tok, messages):
    return tok.encode(load_chat_template(MODEL).render(messages))


def test_chat_greedy_and_seeded_stream(client, reference, tok):
    messages = [{"role": "system", "content": "You answer in one line."},
                {"role": "user", "content": "What does a prefill worker do?"}]
    assert load_chat_template(MODEL).render(messages).endswith("<|user|>What does a prefill worker do?\n<|assistant|>")
    ids = chat_ids(tok, messages)
    out = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=12, temperature=0)
    want = expected(reference, ids, 12)
    assert out.choices[0].token_ids == want and out.choices[0].message.content == tok.decode(want)
    assert out.choices[0].message.role == "assistant" and out.usage.prompt_tokens == len(ids)

    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=15, stream=True,
                                            temperature=1.2, seed=3, user="tester")
    text, got, finish, usage, _ = collect(stream)
    want = expected(reference, ids, 15, temperature=1.2, seed=3)
    assert got == want and text == tok.decode(want) and finish == finish_of(want, 15)
    assert usage is None  # not asked for


def test_cached_tokens_on_repeated_long_prefix(client, reference, tok):
    prefix = "".join(chr(65 + (i * 7) % 26) for i in range(320))  # 320 byte tokens = 20 blocks
    first = client.completions.create(model=MODEL, prompt=prefix + " first question", max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second_text = prefix + " second question"
    second = client.completions.create(model=MODEL, prompt=second_text, max_tokens=8, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.usage.prompt_tokens_details.cached_tokens % 16 == 0
    assert second.choices[0].token_ids == expected(reference, tok.encode(second_text), 8)
    # The same reuse through chat: the system prompt is the shared prefix.
    messages = [{"role": "system", "content": prefix}, {"role": "user", "content": "hello"}]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    again = client.chat.completions.create(model=MODEL, messages=messages[:1] + [{"role": "user", "content": "bye"}],
                                           max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def one_char_tokens(tok, ids, k):
    return all(len(tok.decode([t])) == 1 for t in ids[k:k + 2])


def pick_stop(tok, want):
    """A two-character stop string spanning tokens k and k+1 of the greedy output, at its first
    occurrence, so the text before it is exactly text[:k]."""
    text = tok.decode(want)
    for k in range(4, len(want) - 2):
        stop = text[k:k + 2]
        if one_char_tokens(tok, want, k) and len(tok.decode(want[:k])) == k and text.find(stop) == k:
            return k, stop
    raise AssertionError(f"no usable stop string in {text!r}")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_spanning_two_tokens(client, reference, tok, cluster, stream):
    ids = prompt(50, 7)
    want = expected(reference, ids, 40)
    k, stop = pick_stop(tok, want)
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=40, temperature=0, stop=[stop, "never!"],
                                    stream=stream)
    if stream:
        text, got, finish, _, _ = collect(out)
    else:
        text, got, finish = out.choices[0].text, out.choices[0].token_ids, out.choices[0].finish_reason
    assert finish == "stop"
    assert text == tok.decode(want)[:k] and stop not in text
    assert got == want[:k + 2]  # every token received, up to the one that completed the stop string
    # The match cancelled the request: its pages are freed on both workers.
    stats = wait_all_freed(cluster)
    assert all(s.num_live_requests == 0 and s.num_free_pages == s.num_pages_total for s in stats.values()), stats


def test_stop_token_ids_extension(client, reference, tok):
    ids = prompt(30, 9)
    want = expected(reference, ids, 24)
    stop_id = want[6]
    cut = want.index(stop_id) + 1
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0,
                                    extra_body={"stop_token_ids": [stop_id]})
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].token_ids == want[:cut]
    assert out.choices[0].text == tok.decode(want[:cut])  # the stop token's own text is kept, as vLLM does


def test_bad_request_raises_openai_error(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4, n=2)
    assert e.value.status_code == 400 and e.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=4)
