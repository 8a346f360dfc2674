"""CostModels as a value: the analytic formulas exactly, the file round trip, and every kind of
bad file rejected with a CalibrationError that names the file."""

from __future__ import annotations

import copy
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from costmodel import (
    CalibrationError,
    CalibrationInfo,
    CostModels,
    FitError,
    LinkCost,
    default_calibration_path,
)
from costmodel.storage import load_models, save_models, to_json
from kvstore.blocks import Tier

REPO_ROOT = Path(__file__).resolve().parents[2]


def analytic() -> CostModels:
    return CostModels.analytic(
        prefill_s_per_token=1e-3, prefill_s_per_token_sq=2e-7, reuse_s_per_token=3e-5,
        decode_base_s=4e-3, decode_s_per_request=5e-4, decode_s_per_context_token=6e-7,
        transfer_bytes_per_s=2e9, transfer_latency_s=1e-4, kv_bytes_per_token=1280, snapshot_bytes=299008,
    )


def fitted() -> CostModels:
    """A model of the shape calibration produces: every field set, tiers and errors included."""
    return CostModels(
        kv_bytes_per_token=1280, snapshot_bytes=299008, prefill_const_s=0.04, prefill_s_per_token=1e-3,
        prefill_s_per_token_x_reused=1e-8, prefill_s_per_token_sq=2e-8, reuse_s_per_token=1e-5,
        decode_base_s=5e-3, decode_s_per_request=6e-4, decode_s_per_context_token=7e-7,
        links={"tcp": LinkCost(3e-5, 4e-9), "shm": LinkCost(2e-4, 3e-9)},
        tier_reads={Tier.DRAM: LinkCost(1e-5, 2e-11), Tier.SSD: LinkCost(0.0, 2.5e-9)},
        fit_errors={"prefill": FitError(0.07, 0.15, 9, 3), "decode": FitError(0.05, 0.1, 9, 2)},
        info=CalibrationInfo(model_fingerprint="fp-tiny", model_name="tiny", device="cpu", torch_threads=1,
                             created_at="2026-01-01T00:00:00+00:00", grid="quick", block_size=32,
                             snapshot_interval_blocks=4, torch_version="2.13.0", wall_s=12.5),
    )


# ---- formulas ------------------------------------------------------------------------------------


def test_analytic_formulas_are_exact():
    m = analytic()
    for new, reused in [(0, 0), (1, 0), (100, 0), (100, 512), (7, 4096)]:
        want = new * 1e-3 + new * (new + reused) * 2e-7 + reused * 3e-5
        assert m.prefill_s(new, reused) == pytest.approx(want, rel=1e-12, abs=0)
    assert m.decode_step_s(0, 0) == 0.0
    assert m.decode_step_s(0, 5000) == 0.0
    assert m.decode_step_s(8, 4096) == pytest.approx(4e-3 + 8 * 5e-4 + 4096 * 6e-7, rel=1e-12)
    for backend in ("tcp", "shm", "ucx"):
        for tier in Tier:
            assert m.transfer_s(10**6, backend, tier) == pytest.approx(1e-4 + 10**6 / 2e9, rel=1e-12)
    assert m.transfer_s(0) == 0.0
    assert m.pull_s(64, 2) == pytest.approx(m.transfer_s(64 * 1280 + 2 * 299008), rel=1e-12)
    assert m.pull_bytes(64, 2) == 64 * 1280 + 2 * 299008


def test_fitted_form_adds_tier_read_and_falls_back_for_ucx_and_device():
    m = fitted()
    num_bytes = 5 << 20
    tcp = 3e-5 + num_bytes * 4e-9
    assert m.transfer_s(num_bytes, "tcp", Tier.DRAM) == pytest.approx(tcp + 1e-5 + num_bytes * 2e-11)
    assert m.transfer_s(num_bytes, "tcp", Tier.SSD) == pytest.approx(tcp + num_bytes * 2.5e-9)
    assert m.transfer_s(num_bytes, "ucx") == m.transfer_s(num_bytes, "tcp")  # ucx not measured: tcp's fit
    assert m.read_s(num_bytes, Tier.DEVICE) == m.read_s(num_bytes, Tier.DRAM)
    assert m.prefill_s(100, 64) == pytest.approx(0.04 + 0.1 + 100 * 64 * 1e-8 + 100 * 100 * 2e-8 + 64 * 1e-5)


def test_bad_arguments_raise_value_error_with_the_numbers():
    m = analytic()
    with pytest.raises(ValueError, match="-1"):
        m.prefill_s(-1, 0)
    with pytest.raises(ValueError, match="-3"):
        m.decode_step_s(2, -3)
    with pytest.raises(ValueError, match="-5"):
        m.transfer_s(-5)
    with pytest.raises(ValueError, match="rdma"):
        m.transfer_s(10, "rdma")
    with pytest.raises(ValueError, match="transfer_bytes_per_s"):
        CostModels.analytic(prefill_s_per_token=1e-3, decode_base_s=1e-3, transfer_bytes_per_s=0)
    with pytest.raises(ValueError, match="reuse_s_per_token"):
        CostModels.analytic(prefill_s_per_token=1e-3, decode_base_s=1e-3, reuse_s_per_token=-1.0)


@pytest.mark.parametrize("make", [analytic, fitted])
def test_value_is_frozen_and_pickles(make):
    models = make()
    assert pickle.loads(pickle.dumps(models)) == models
    assert copy.deepcopy(models) == models
    with pytest.raises(TypeError):
        models.links["tcp"] = LinkCost(0.0, 0.0)  # type: ignore[index]
    with pytest.raises(AttributeError):
        models.decode_base_s = 1.0  # type: ignore[misc]


def test_calibration_path_is_keyed_by_fingerprint_device_and_threads(tmp_path):
    base = default_calibration_path(tmp_path, "abc123", "cpu", 1)
    assert base.parent == tmp_path / "calibration" and base.suffix == ".json"
    others = {default_calibration_path(tmp_path, "abc124", "cpu", 1), default_calibration_path(tmp_path, "abc123",
              "cuda:0", 1), default_calibration_path(tmp_path, "abc123", "cpu", 2)}
    assert base not in others and len(others) == 3
    assert "/" not in default_calibration_path(tmp_path, "a/b", "cuda:0", 1).name


def test_package_import_loads_neither_torch_nor_numpy():
    code = "import sys, costmodel; sys.exit(bool({'torch', 'numpy'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT).returncode == 0


# ---- files ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [analytic, fitted])
def test_save_load_round_trip_is_equal(tmp_path, make):
    models = make()
    path = tmp_path / "sub" / "cal.json"
    save_models(models, path)
    assert load_models(path) == models
    raw = json.loads(path.read_text())
    assert (raw["format"], raw["version"]) == ("tidekv-calibration", 1)
    assert not list(path.parent.glob(".*.tmp")), "the temporary file of the atomic write is left behind"


def _mutate(raw: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    for key in parents:
        raw = raw[key]
    if value is _DELETE:
        del raw[last]
    else:
        raw[last] = value


_DELETE = object()
CORRUPTIONS = {
    "wrong format": ("format", "something-else", "format"),
    "wrong version": ("version", 2, "version 2"),
    "NaN coefficient": ("coefficients.prefill_s_per_token", float("nan"), "prefill_s_per_token"),
    "infinite coefficient": ("links.tcp.s_per_byte", float("inf"), "links.tcp.s_per_byte"),
    "negative coefficient": ("coefficients.decode_base_s", -1.0, "decode_base_s"),
    "string coefficient": ("coefficients.reuse_s_per_token", "fast", "reuse_s_per_token"),
    "missing coefficient": ("coefficients.decode_s_per_request", _DELETE, "decode_s_per_request"),
    "missing section": ("links", _DELETE, "links"),
    "no tcp link": ("links.tcp", _DELETE, "tcp"),
    "unknown tier": ("tier_reads.TAPE", {"latency_s": 0.0, "s_per_byte": 0.0}, "TAPE"),
    "negative size": ("kv_bytes_per_token", -4, "kv_bytes_per_token"),
    "bad info": ("info.torch_threads", "one", "torch_threads"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corrupt_field_raises_calibration_error_naming_the_file(tmp_path, case):
    dotted, value, mentioned = CORRUPTIONS[case]
    raw = to_json(fitted())
    _mutate(raw, dotted, value)
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(raw))  # json writes NaN / Infinity literals, as a hand edit might
    with pytest.raises(CalibrationError) as err:
        load_models(path)
    assert str(path) in str(err.value) and mentioned in str(err.value)


@pytest.mark.parametrize("text", ["", "{\"format\": \"tidekv-calib", "[1, 2]", "null"])
def test_truncated_or_non_object_file_raises_calibration_error(tmp_path, text):
    path = tmp_path / "cal.json"
    path.write_text(text)
    with pytest.raises(CalibrationError, match=str(path)):
        load_models(path)


def test_truncated_real_file_raises_calibration_error(tmp_path):
    path = tmp_path / "cal.json"
    save_models(fitted(), path)
    path.write_text(path.read_text()[: len(path.read_text()) // 2])
    with pytest.raises(CalibrationError, match="not valid JSON"):
        load_models(path)


def test_missing_file_raises_calibration_error(tmp_path):
    with pytest.raises(CalibrationError, match=str(tmp_path / "absent.json")):
        load_models(tmp_path / "absent.json")


@pytest.mark.parametrize("kwargs, got, want", [
    ({"model_fingerprint": "fp-other"}, "fp-tiny", "fp-other"),
    ({"device": "cuda"}, "cpu", "cuda"),
    ({"threads": 2}, "1", "2"),
])
def test_setup_mismatch_names_both_values(tmp_path, kwargs, got, want):
    path = tmp_path / "cal.json"
    save_models(fitted(), path)
    with pytest.raises(CalibrationError) as err:
        load_models(path, **kwargs)
    message = str(err.value)
    assert str(path) in message and got in message and want in message


def test_matching_setup_loads(tmp_path):
    path = tmp_path / "cal.json"
    save_models(fitted(), path)
    assert load_models(path, model_fingerprint="fp-tiny", device="cpu", threads=1) == fitted()
