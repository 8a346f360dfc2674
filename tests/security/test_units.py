"""The pieces of authentication on their own: signatures, grants, API key files, limits."""

from __future__ import annotations

import json
import time

import grpc
import pytest

import engine
from conductor.apikeys import ApiKeys, add_key, parse_keys
from conductor.validation import Limits, validate
from proto import inference_pb2 as pb
from runtime.auth import (
    AUTH_HEADER,
    CONDUCTOR,
    AuthError,
    Nonces,
    check_grant,
    grant,
    load_secret,
    session_key,
    sign,
    verify,
)

KEY = b"k" * 32
METHOD = "/tidekv.v1.Decode/Reserve"


def check(metadata, key_for=lambda p: KEY, nonces=None, method=METHOD, now_s=None) -> str:
    return verify(dict(metadata), method, key_for, nonces or Nonces(), now_s)


def code(fn) -> grpc.StatusCode:
    with pytest.raises(AuthError) as e:
        fn()
    return e.value.code


def test_a_signature_holds_once_for_its_method_key_and_time():
    md = sign(KEY, CONDUCTOR, METHOD)
    nonces = Nonces()
    assert check(md, nonces=nonces) == CONDUCTOR
    assert code(lambda: check(md, nonces=nonces)) == grpc.StatusCode.UNAUTHENTICATED  # replayed
    assert code(lambda: check(sign(KEY, CONDUCTOR, METHOD), method="/tidekv.v1.Decode/Release")) == \
        grpc.StatusCode.UNAUTHENTICATED
    assert code(lambda: check(sign(b"x" * 32, CONDUCTOR, METHOD))) == grpc.StatusCode.UNAUTHENTICATED
    assert code(lambda: check(sign(KEY, CONDUCTOR, METHOD, now_s=time.time() - 120))) == \
        grpc.StatusCode.UNAUTHENTICATED
    assert code(lambda: check(sign(KEY, "worker/w", METHOD), key_for=lambda p: None)) == \
        grpc.StatusCode.PERMISSION_DENIED
    assert code(lambda: check(())) == grpc.StatusCode.UNAUTHENTICATED
    tampered = dict(sign(KEY, CONDUCTOR, METHOD))
    tampered["x-tidekv-principal"] = "operator"
    assert code(lambda: check(tampered.items())) == grpc.StatusCode.UNAUTHENTICATED
    assert code(lambda: check({AUTH_HEADER: "junk", "x-tidekv-principal": CONDUCTOR}.items())) == \
        grpc.StatusCode.UNAUTHENTICATED


def test_session_keys_differ_by_instance_and_worker():
    s = b"s" * 64
    assert session_key(s, "w", "i1") != session_key(s, "w", "i2") != session_key(s, "v", "i2")
    assert session_key(s, "w", "i1") == session_key(s, "w", "i1")


def test_a_grant_covers_exactly_one_pull():
    keys = [b"a" * 32, b"b" * 32]
    mac, expiry = grant(KEY, "r1", "p1", "tcp://h:1", keys, ttl_s=30)
    check_grant(KEY, mac, expiry, "r1", "p1", "tcp://h:1", keys)
    for args in (("r2", "p1", "tcp://h:1", keys), ("r1", "p2", "tcp://h:1", keys),
                 ("r1", "p1", "tcp://h:2", keys), ("r1", "p1", "tcp://h:1", keys[:1]),
                 ("r1", "p1", "tcp://h:1", keys[::-1])):
        assert code(lambda a=args: check_grant(KEY, mac, expiry, *a)) == grpc.StatusCode.PERMISSION_DENIED
    assert code(lambda: check_grant(b"z" * 32, mac, expiry, "r1", "p1", "tcp://h:1", keys)) == \
        grpc.StatusCode.PERMISSION_DENIED
    old, old_expiry = grant(KEY, "r1", "p1", "tcp://h:1", keys, ttl_s=-1)
    with pytest.raises(AuthError, match="expired"):
        check_grant(KEY, old, old_expiry, "r1", "p1", "tcp://h:1", keys)


def test_a_short_or_missing_secret_file_is_an_error_naming_it(tmp_path):
    short = tmp_path / "short"
    short.write_text("abc")
    with pytest.raises(ValueError, match=str(short)):
        load_secret(str(short))
    with pytest.raises(ValueError, match="missing"):
        load_secret(str(tmp_path / "missing"))


def test_api_keys_bind_tenants_and_reload(tmp_path, monkeypatch):
    path = tmp_path / "keys.json"
    acme = add_key(str(path), "acme", sub_tenants=["acme-eu"])
    keys = ApiKeys(str(path))
    found = keys.authenticate([("authorization", f"Bearer {acme}")])
    assert found.tenant_for("") == "acme" and found.tenant_for("acme-eu") == "acme-eu"
    with pytest.raises(AuthError, match="not 'globex'") as e:
        found.tenant_for("globex")
    assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
    for header in ("", "Basic abc", "Bearer ", f"Bearer {acme}x"):
        with pytest.raises(AuthError) as e:
            keys.authenticate([("authorization", header)])
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert acme not in path.read_text(), "the file keeps digests only"
    monkeypatch.setattr("conductor.apikeys.RELOAD_CHECK_S", 0.0)
    keys._next_check = 0.0
    globex = add_key(str(path), "globex")
    assert keys.authenticate([("authorization", f"Bearer {globex}")]).tenant == "globex"
    path.write_text("{not json")  # a broken edit keeps the last good keys
    keys._next_check = 0.0
    assert keys.authenticate([("authorization", f"Bearer {globex}")]).tenant == "globex"


def test_a_bad_keys_file_names_the_entry(tmp_path):
    with pytest.raises(ValueError, match=r"keys\[0\].*sha256"):
        parse_keys(json.dumps({"keys": [{"tenant": "a"}]}), "f.json")
    with pytest.raises(ValueError, match=r"keys\[0\].*tenant"):
        parse_keys(json.dumps({"keys": [{"sha256": "0" * 64}]}), "f.json")
    with pytest.raises(ValueError, match="f.json: not JSON"):
        parse_keys("[", "f.json")


def test_prompt_bytes_are_checked_before_tokenization():
    cfg, tok = engine.load_config("tiny"), engine.load_tokenizer("tiny")
    limits = Limits(max_prompt_tokens=8000, max_prompt_bytes=1000)
    req = pb.GenerateRequest(text="é" * 501, sampling=pb.SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match=r"text: 1002 bytes of UTF-8, the limit is 1000 \(max_prompt_bytes\)"):
        validate(req, cfg, tok, limits)
    assert validate(pb.GenerateRequest(text="é" * 500, sampling=pb.SamplingParams(max_tokens=1)), cfg, tok, limits)
    ids = pb.TokenIds(ids=[1] * 9000)
    with pytest.raises(ValueError, match="token_ids: 9000 tokens, the limit is 8000"):
        validate(pb.GenerateRequest(token_ids=ids, sampling=pb.SamplingParams(max_tokens=1)), cfg, tok, limits)
