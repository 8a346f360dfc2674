"""Rendering the kustomizations of deploy/k8s and reading the objects, shared by the test_k8s_* files.

``rendered(target)`` runs ``kubectl kustomize`` once per session for the base or an overlay and
hands each caller a fresh copy to read or break; the readers below walk a render (workloads, pod
templates, Tidekv containers and the environment they start with); ``_find``, ``_container`` and
``_set_env`` are what the files' tables of broken renders (``MUTATIONS``) break them with.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
TARGETS = ["base", *sorted(f"overlays/{p.parent.name}" for p in (K8S / "overlays").glob("*/kustomization.yaml"))]
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet"}
# Values the downward API fills in at run time, for the settings checks.
FIELD_REF_SAMPLES = {"status.podIP": "10.0.0.7", "metadata.name": "tidekv-prefill-0"}


def _render(target: str) -> list[dict]:
    yaml = pytest.importorskip("yaml", reason="PyYAML comes with kubernetes-validate (the test extras)")
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not on PATH: the kustomizations cannot be rendered (install kubectl to run these)")
    out = subprocess.run([kubectl, "kustomize", str(K8S / target)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"kubectl kustomize {target} failed:\n{out.stderr}"
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


_RENDERS: dict[str, list[dict]] = {}


def rendered(target: str) -> list[dict]:
    """The objects of one kustomization, rendered once per session; a fresh copy (callers mutate it)."""
    if target not in _RENDERS:
        _RENDERS[target] = _render(target)
    return copy.deepcopy(_RENDERS[target])


# ---- reading a render ---------------------------------------------------------------------------

def pods(objs: list[dict]) -> Iterator[tuple[dict, dict]]:
    """(workload, pod template) for every workload in the render."""
    for obj in objs:
        if obj["kind"] in WORKLOAD_KINDS:
            yield obj, obj["spec"]["template"]


def containers(template: dict) -> list[dict]:
    spec = template["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def tidekv_containers(objs: list[dict]) -> Iterator[tuple[str, dict, dict]]:
    """(role, workload, container) for every container started as ``tidekv serve --role ROLE``."""
    for workload, template in pods(objs):
        for c in template["spec"]["containers"]:
            args = c.get("args", [])
            if "--role" in args:
                yield args[args.index("--role") + 1], workload, c


def matches(selector: dict, labels: dict) -> bool:
    """A LabelSelector (matchLabels/matchExpressions) or a Service's plain selector map."""
    if "matchLabels" not in selector and "matchExpressions" not in selector:
        selector = {"matchLabels": selector}
    if not selector.get("matchLabels") and not selector.get("matchExpressions"):
        return True  # the empty selector selects everything
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok = {"In": labels.get(key) in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def probes(container: dict) -> Iterator[tuple[str, dict]]:
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        if kind in container:
            yield kind, container[kind]


def probe_port(probe: dict) -> int | str | None:
    for handler in ("grpc", "httpGet", "tcpSocket"):
        if handler in probe:
            return probe[handler]["port"]
    return None


def container_env(objs: list[dict], container: dict) -> dict[str, str]:
    """The environment the container starts with: its ConfigMaps, then its own entries."""
    maps = {o["metadata"]["name"]: o.get("data", {}) for o in objs if o["kind"] == "ConfigMap"}
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(maps[source["configMapRef"]["name"]])
    for e in container.get("env", []):
        env[e["name"]] = e["value"] if "value" in e else FIELD_REF_SAMPLES[e["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


# ---- breaking a render on purpose -----------------------------------------------------------------

def _find(objs: list[dict], kind: str, name: str) -> dict:
    return next(o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name)


def _container(objs: list[dict], role: str) -> dict:
    return next(c for r, _, c in tidekv_containers(objs) if r == role)


def _set_env(objs: list[dict], role: str, key: str, value: str) -> None:
    _container(objs, role).setdefault("env", []).append({"name": key, "value": value})
