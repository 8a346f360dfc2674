"""The pieces of authentication on their own: signatures, grants, API key files, limits."""

from __future__ import annotations

import json
import time

import grpc
import pytest

import engine
from conductor.admission import TenantLimits
from conductor.apikeys import ApiKeys, add_key, parse_keys
from conductor.validation import Limits, validate
from proto import inference_pb2 as pb
from runtime.auth import (
    AUDIENCE_HEADER,
    AUTH_HEADER,
    CONDUCTOR,
    MAX_LEAD_S,
    MAX_SKEW_S,
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
AUDIENCE = "worker/decode-0"
BODY = b"\n\x03req\x10\x05"


def check(metadata, key_for=lambda p: KEY, nonces=None, method=METHOD, now_s=None, body=BODY, audience=AUDIENCE,
          floor_s=0.0) -> str:
    nonces = nonces if nonces is not None else Nonces()
    return verify(dict(metadata), method, body, audience, key_for, nonces, floor_s, now_s)


def signature(key=KEY, principal=CONDUCTOR, method=METHOD, audience=AUDIENCE, body=BODY, now_s=None):
    return sign(key, principal, method, audience, body, now_s)


def code(fn) -> grpc.StatusCode:
    with pytest.raises(AuthError) as e:
        fn()
    return e.value.code


def refused(fn, what: str) -> str:
    """The UNAUTHENTICATED message ``fn`` fails with; it must name ``what``."""
    with pytest.raises(AuthError) as e:
        fn()
    assert e.value.code == grpc.StatusCode.UNAUTHENTICATED and str(e.value).startswith(what), str(e.value)
    return str(e.value)


def test_a_signature_holds_once_for_its_method_key_and_time():
    md = signature()
    nonces = Nonces()
    assert check(md, nonces=nonces) == CONDUCTOR
    refused(lambda: check(md, nonces=nonces), "replay")
    assert code(lambda: check(signature(), method="/tidekv.v1.Decode/Release")) == grpc.StatusCode.UNAUTHENTICATED
    assert code(lambda: check(signature(key=b"x" * 32))) == grpc.StatusCode.UNAUTHENTICATED
    refused(lambda: check(signature(now_s=time.time() - 120)), "skew")
    assert code(lambda: check(signature(principal="worker/w"), key_for=lambda p: None)) == \
        grpc.StatusCode.PERMISSION_DENIED
    assert code(lambda: check(())) == grpc.StatusCode.UNAUTHENTICATED
    tampered = dict(signature())
    tampered["x-tidekv-principal"] = "operator"
    assert code(lambda: check(tampered.items())) == grpc.StatusCode.UNAUTHENTICATED
    assert code(lambda: check({AUTH_HEADER: "junk", "x-tidekv-principal": CONDUCTOR}.items())) == \
        grpc.StatusCode.UNAUTHENTICATED


def test_a_signature_binds_the_body_and_the_audience():
    nonces = Nonces()
    md = signature()
    refused(lambda: check(md, nonces=nonces, body=BODY + b"\x18\x01"), "body")
    refused(lambda: check(md, nonces=nonces, audience="worker/decode-1"), "audience")
    forged = dict(md)
    forged[AUDIENCE_HEADER] = "worker/decode-1"  # the header says it, the MAC does not
    refused(lambda: check(forged.items(), nonces=nonces, audience="worker/decode-1"), "bad credential")
    assert check(md, nonces=nonces) == CONDUCTOR, "a refused call does not spend the nonce"
    assert check(signature(body=b""), body=b"") == CONDUCTOR


def test_clock_limits_and_the_floor():
    now = time.time()
    assert check(signature(now_s=now + MAX_LEAD_S - 0.1), now_s=now) == CONDUCTOR
    refused(lambda: check(signature(now_s=now + MAX_LEAD_S + 0.5), now_s=now), "skew")
    assert check(signature(now_s=now - MAX_SKEW_S + 1), now_s=now) == CONDUCTOR
    message = refused(lambda: check(signature(now_s=now - 4), now_s=now, floor_s=now - 1), "floor")
    assert "3.0 s before this server's start" in message
    assert check(signature(now_s=now - 0.5), now_s=now, floor_s=now - 1) == CONDUCTOR


def test_an_old_format_is_named():
    old = {"x-tidekv-principal": CONDUCTOR, AUTH_HEADER: f"{int(time.time() * 1000)}.abcd.{'0' * 64}"}
    assert "v1 (unversioned)" in refused(lambda: check(old.items()), AUTH_HEADER)


def test_the_nonce_store_is_pluggable_and_forgets_expired_nonces():
    calls = []

    class Shared:
        def first_use(self, nonce: str, expires_s: float) -> bool:
            calls.append((nonce, expires_s))
            return len(calls) == 1

    md = signature()
    assert check(md, nonces=Shared()) == CONDUCTOR
    refused(lambda: check(md, nonces=Shared()), "replay")  # another server sharing the store
    ms = int(dict(md)[AUTH_HEADER].split(".")[1])
    assert calls[0][1] == pytest.approx(ms / 1000 + MAX_SKEW_S)
    now = [100.0]
    mem = Nonces(clock=lambda: now[0], prune_every_s=0.0)
    assert mem.first_use("a", 150.0) and not mem.first_use("a", 150.0)
    now[0] = 151.0
    assert mem.first_use("b", 200.0) and mem.num_nonces == 1


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


def test_keys_carry_their_tenants_admission_limits(tmp_path):
    path = tmp_path / "keys.json"
    acme = add_key(str(path), "acme", limits=TenantLimits(max_running=4, max_queued=2, weight=2.0))
    again = add_key(str(path), "acme", name="acme-2")  # takes the tenant's limits
    other = add_key(str(path), "globex")
    keys = ApiKeys(str(path))
    found = {k: keys.authenticate([("authorization", f"Bearer {k}")]) for k in (acme, again, other)}
    assert found[acme].limits == found[again].limits == TenantLimits(4, 2, 2.0)
    assert found[other].limits == TenantLimits()
    add_key(str(path), "acme", limits=TenantLimits(max_running=1))  # rewrites every acme key's limits
    assert {e["max_running"] for e in json.loads(path.read_text())["keys"] if e["tenant"] == "acme"} == {1}
    entry = {"sha256": "0" * 64, "tenant": "a"}
    with pytest.raises(ValueError, match=r"keys\[1\]: tenant 'a' has other limits in keys\[0\]"):
        parse_keys(json.dumps({"keys": [{**entry, "weight": 2}, {**entry, "sha256": "1" * 64}]}), "f.json")
    for bad, message in (({"max_running": 0}, "max_running 0 must be >= 1"), ({"weight": "x"}, "weight"),
                         ({"max_queued": 1.5}, "max_queued")):
        with pytest.raises(ValueError, match=rf"keys\[0\].*{message}"):
            parse_keys(json.dumps({"keys": [{**entry, **bad}]}), "f.json")


def test_apikey_add_takes_the_limits_flags(tmp_path, capsys):
    from deploy.cli import main

    path = tmp_path / "keys.json"
    main(["apikey", "add", "--file", str(path), "--tenant", "acme", "--max-running", "3", "--weight", "0.5"])
    key = capsys.readouterr().out.strip()
    assert ApiKeys(str(path)).authenticate([("authorization", f"Bearer {key}")]).limits == TenantLimits(3, None, 0.5)
