"""Offline checks of who reaches whom in the Kubernetes manifests (deploy/k8s), and with what credentials.

The checks no schema can make about the objects between pods, each a function returning a list of
problems (empty when the render is sound), run on every kustomization: Services, budgets and
NetworkPolicies select real pods and name ports they declare; every role reads the cluster
secret and the API keys from a Secret volume it mounts (the HTTP front gets no cluster secret);
the ServiceMonitor, a custom resource no bundled schema covers, is checked here field by field.
A test breaks a render on purpose to show that each check does fail. Last, docs/deploy.md
states what the render does: the Secrets it creates are the ones the pods mount, its commands
make what the pods read, it names the address workers register with, and what is left off.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Callable

import pytest

from tests.deploy.k8s_support import (
    ROOT,
    TARGETS,
    _container,
    _find,
    _set_env,
    container_env,
    containers,
    matches,
    pods,
    probe_port,
    probes,
    rendered,
    tidekv_containers,
)

# ---- the pods and ports an object reaches ---------------------------------------------------------

def selected(objs: list[dict], selector: dict, namespace: str | None) -> list[dict]:
    return [t for w, t in pods(objs)
            if w["metadata"].get("namespace") == namespace and matches(selector, t["metadata"].get("labels", {}))]


def declared_ports(template: dict) -> set[int | str]:
    ports: set[int | str] = set()
    for c in containers(template):
        for p in c.get("ports", []):
            ports.add(p["containerPort"])
            if "name" in p:
                ports.add(p["name"])
    return ports


# ---- checks: each returns the problems it finds ---------------------------------------------------

def check_ports(objs: list[dict]) -> list[str]:
    """Probes and Services target declared container ports; Services and PDBs select real pods."""
    problems = []
    for workload, template in pods(objs):
        declared = declared_ports(template)
        for c in containers(template):
            problems += [f"{workload['metadata']['name']}/{c['name']}: {kind} targets undeclared port {probe_port(p)}"
                         for kind, p in probes(c) if probe_port(p) is not None and probe_port(p) not in declared]
    for svc in (o for o in objs if o["kind"] == "Service"):
        backends = selected(objs, svc["spec"].get("selector", {}), svc["metadata"].get("namespace"))
        if not backends:
            problems.append(f"Service {svc['metadata']['name']} selects no pod")
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            problems += [f"Service {svc['metadata']['name']}: targetPort {target} not declared by a selected pod"
                         for t in backends if target not in declared_ports(t)]
    for pdb in (o for o in objs if o["kind"] == "PodDisruptionBudget"):
        if len(selected(objs, pdb["spec"]["selector"], pdb["metadata"].get("namespace"))) != 1:
            problems.append(f"PodDisruptionBudget {pdb['metadata']['name']} must select exactly one workload")
    budgets = [o for o in objs if o["kind"] == "PodDisruptionBudget"]
    for role, workload, _ in tidekv_containers(objs):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        if not any(matches(b["spec"]["selector"], labels) for b in budgets):
            problems.append(f"the {role} pool has no PodDisruptionBudget")
    return problems


def check_network_policies(objs: list[dict]) -> list[str]:
    """Each policy and each pod peer in it selects pods of the render; named ports exist on them."""
    problems = []
    for pol in (o for o in objs if o["kind"] == "NetworkPolicy"):
        name, ns = pol["metadata"]["name"], pol["metadata"].get("namespace")
        targets = selected(objs, pol["spec"]["podSelector"], ns)
        if not targets:
            problems.append(f"NetworkPolicy {name} selects no pod")
        for rule in pol["spec"].get("ingress", []):
            local_peers = [p["podSelector"] for p in rule.get("from", []) if "namespaceSelector" not in p
                           and "podSelector" in p]
            problems += [f"NetworkPolicy {name}: a peer selects no pod"
                         for peer in local_peers if not selected(objs, peer, ns)]
            problems += [f"NetworkPolicy {name}: port {p['port']} is not declared by the pods it selects"
                         for p in rule.get("ports", []) for t in targets if p["port"] not in declared_ports(t)]
    selectors = [p["spec"]["podSelector"] for p in objs if p["kind"] == "NetworkPolicy"]
    problems += [f"{w['metadata']['name']}: no NetworkPolicy covers its pods" for w, t in pods(objs)
                 if not any(matches(sel, t["metadata"]["labels"]) for sel in selectors)]
    return problems


def check_credentials(objs: list[dict]) -> list[str]:
    """Every member role reads the cluster secret from a Secret volume it mounts; the Conductor
    and the HTTP front read the API keys the same way and never serve without them; the front
    (it signs nothing) neither gets nor mounts the cluster secret."""
    problems = []
    for role, workload, c in tidekv_containers(objs):
        env = container_env(objs, c)
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"].get("volumes", [])}
        if role == "http":
            secrets = [v["name"] for v in volumes.values() if v.get("secret", {}).get("secretName")
                       == "tidekv-cluster-secret"]
            if "TIDEKV_CLUSTER_SECRET_FILE" in env or secrets:
                problems.append("http: the front is given the cluster secret")
        needed = (["TIDEKV_CLUSTER_SECRET_FILE"] if role != "http" else []) + \
            (["TIDEKV_API_KEYS"] if role in ("conductor", "http") else [])
        for key in needed:
            path = env.get(key, "")
            mounts = [m for m in c.get("volumeMounts", []) if path.startswith(m["mountPath"].rstrip("/") + "/")]
            if not path or not mounts or "secret" not in volumes.get(mounts[0]["name"], {}):
                problems.append(f"{role}: {key}={path!r} is not a file of a mounted Secret")
        if env.get("TIDEKV_INSECURE_NO_AUTH", "0") not in ("0", "false"):
            problems.append(f"{role}: TIDEKV_INSECURE_NO_AUTH is on")
    return problems


SERVICE_MONITOR_SPEC = {"selector", "endpoints", "namespaceSelector", "podTargetLabels", "targetLabels", "jobLabel",
                        "sampleLimit", "targetLimit", "labelLimit", "attachMetadata"}
SERVICE_MONITOR_ENDPOINT = {"port", "targetPort", "path", "scheme", "interval", "scrapeTimeout", "honorLabels",
                            "honorTimestamps", "relabelings", "metricRelabelings", "params", "tlsConfig",
                            "authorization", "followRedirects", "enableHttp2", "filterRunning"}
DURATION = re.compile(r"(\d+(ms|s|m|h))+")


def check_service_monitors(objs: list[dict]) -> list[str]:
    """ServiceMonitor (monitoring.coreos.com/v1) by hand: no bundled schema covers CRDs."""
    problems = []
    services = [o for o in objs if o["kind"] == "Service"]
    for sm in (o for o in objs if o["kind"] == "ServiceMonitor"):
        name, spec = sm["metadata"]["name"], sm.get("spec", {})
        if sm["apiVersion"] != "monitoring.coreos.com/v1" or set(sm) - {"apiVersion", "kind", "metadata", "spec"}:
            problems.append(f"ServiceMonitor {name}: unexpected apiVersion or top-level fields")
        problems += [f"ServiceMonitor {name}: unknown spec field {k}" for k in set(spec) - SERVICE_MONITOR_SPEC]
        if set(spec.get("selector", {})) - {"matchLabels", "matchExpressions"}:
            problems.append(f"ServiceMonitor {name}: malformed selector")
        targets = [s for s in services if s["metadata"].get("namespace") == sm["metadata"].get("namespace")
                   and matches(spec.get("selector", {}), s["metadata"].get("labels", {}))]
        if not targets:
            problems.append(f"ServiceMonitor {name} selects no Service")
        for ep in spec.get("endpoints") or [{}]:
            problems += [f"ServiceMonitor {name}: {p}" for p in _endpoint_problems(ep, targets)]
    return problems


def _endpoint_problems(ep: dict, services: list[dict]) -> list[str]:
    problems = [f"unknown endpoint field {k}" for k in set(ep) - SERVICE_MONITOR_ENDPOINT]
    if ("port" in ep) == ("targetPort" in ep) or not str(ep.get("path", "/")).startswith("/"):
        problems.append("an endpoint needs exactly one of port/targetPort and a /path")
    if ep.get("scheme", "http") not in ("http", "https"):
        problems.append(f"scheme {ep['scheme']!r}")
    problems += [f"{k}={ep[k]!r} is not a duration"
                 for k in ("interval", "scrapeTimeout") if k in ep and not DURATION.fullmatch(ep[k])]
    if "port" in ep:
        problems += [f"Service {s['metadata']['name']} has no port named {ep['port']}"
                     for s in services if ep["port"] not in {p.get("name") for p in s["spec"]["ports"]}]
    return problems


CHECKS: list[Callable[[list[dict]], list[str]]] = [
    check_ports, check_network_policies, check_service_monitors, check_credentials,
]


# ---- tests ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_structure(objs: list[dict], check: Callable[[list[dict]], list[str]]) -> None:
    assert check(objs) == []


# name: (the kustomization broken, how, the check that must notice)
MUTATIONS: dict[str, tuple[str, Callable[[list[dict]], object], Callable[[list[dict]], list[str]]]] = {
    "probe on an undeclared port": ("overlays/cpu-tiny", lambda o: _container(o, "decode")["readinessProbe"][
        "grpc"].update(port=1234), check_ports),
    "Service selects nothing": ("overlays/cpu-tiny", lambda o: _find(o, "Service", "tidekv-conductor")["spec"][
        "selector"].update({"tidekv.io/role": "conductr"}), check_ports),
    "policy selects nothing": ("overlays/cpu-tiny", lambda o: _find(o, "NetworkPolicy", "tidekv-redis")["spec"][
        "podSelector"]["matchLabels"].update({"app.kubernetes.io/name": "redsi"}), check_network_policies),
    "secret not mounted": ("overlays/cpu-tiny", lambda o: _container(o, "prefill")["volumeMounts"].pop(
        next(i for i, m in enumerate(_container(o, "prefill")["volumeMounts"]) if m["name"] == "cluster-secret")),
        check_credentials),
    "front given the cluster secret": ("overlays/cpu-tiny", lambda o: _set_env(
        o, "http", "TIDEKV_CLUSTER_SECRET_FILE", "/etc/tidekv/cluster/secret"), check_credentials),
    "front without keys": ("overlays/gpu", lambda o: _container(o, "http")["volumeMounts"].pop(
        next(i for i, m in enumerate(_container(o, "http")["volumeMounts"]) if m["name"] == "api-keys")),
        check_credentials),
    "public endpoint without keys": ("overlays/gpu", lambda o: _set_env(o, "conductor", "TIDEKV_INSECURE_NO_AUTH",
                                                                        "1"), check_credentials),
    "scrapes a missing port": ("overlays/gpu", lambda o: _find(o, "ServiceMonitor", "tidekv")["spec"]["endpoints"][0]
                               .update(port="metric"), check_service_monitors),
    "misspelled ServiceMonitor field": ("overlays/gpu", lambda o: _find(o, "ServiceMonitor", "tidekv")["spec"][
        "endpoints"][0].update(intervall="15s"), check_service_monitors),
}


@pytest.mark.parametrize("name", MUTATIONS)
def test_checks_catch_a_broken_render(name: str) -> None:
    target, mutate, check = MUTATIONS[name]
    objs = rendered(target)
    assert check(objs) == []
    mutate(objs)
    assert check(objs) != [], f"{check.__name__} missed: {name}"


# ---- docs/deploy.md states what the render does -------------------------------------------------

DEPLOY_DOC = ROOT / "docs" / "deploy.md"


def mounted_secret_files(objs: list[dict]) -> set[tuple[str, str]]:
    """(Secret name, key) of every credential file a Tidekv container reads from a Secret volume."""
    out = set()
    for _, workload, c in tidekv_containers(objs):
        env = container_env(objs, c)
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"].get("volumes", [])}
        for key in ("TIDEKV_CLUSTER_SECRET_FILE", "TIDEKV_API_KEYS", "TIDEKV_INDEX_PASSWORD_FILE"):
            path = env.get(key, "")
            for m in c.get("volumeMounts", []):
                secret = volumes.get(m["name"], {}).get("secret")
                if path and secret and path.startswith(m["mountPath"].rstrip("/") + "/"):
                    out.add((secret["secretName"], path.removeprefix(m["mountPath"].rstrip("/") + "/")))
    return out


def test_deploy_doc_creates_the_secrets_the_pods_mount() -> None:
    doc = DEPLOY_DOC.read_text()
    created = set(re.findall(r"kubectl -n tidekv create secret generic (\S+) --from-file=([\w.]+)=\S+$", doc, re.M))
    assert mounted_secret_files(rendered("overlays/cpu-tiny")) == created == {
        ("tidekv-cluster-secret", "secret"), ("tidekv-api-keys", "keys.json"), ("tidekv-store", "password")}
    generate = re.findall(r"^(.*tidekv generate --endpoint 127.0.0.1:50051.*)$", doc.split("### What is in")[1], re.M)
    assert generate and all("TIDEKV_API_KEY=" in line or "--api-key" in line for line in generate), generate


def test_deploy_docs_secret_commands_make_what_the_pods_read(tmp_path) -> None:
    """The doc's own commands, in its order: `tidekv secret` and `tidekv apikey add` make the
    files, and each `kubectl create secret` (client-side dry run: no cluster) makes a Secret
    whose key holds them."""
    import base64
    import json
    import shlex

    from conductor.apikeys import parse_keys

    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not on PATH")
    doc = DEPLOY_DOC.read_text()
    for line in re.findall(r"^(tidekv (?:secret|apikey add) .*?)(?:\s+#.*)?$", doc, re.M):
        done = subprocess.run([sys.executable, "-m", "deploy.cli", *shlex.split(line)[1:]], cwd=tmp_path,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, (line, done.stderr)
    for line in re.findall(r"^(kubectl -n tidekv create secret generic .*)$", doc, re.M):
        done = subprocess.run([kubectl, *shlex.split(line)[1:], "--dry-run=client", "-o", "json"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, (line, done.stderr)
        secret = json.loads(done.stdout)
        [(key, value)] = secret["data"].items()
        content = base64.b64decode(value).decode()
        if key == "keys.json":
            assert parse_keys(content, key), content
        else:
            assert re.fullmatch(r"[0-9a-f]{64}\s*", content), "the cluster secret file"


def test_deploy_doc_names_the_address_workers_register_with() -> None:
    doc = DEPLOY_DOC.read_text()
    for role, _, c in tidekv_containers(objs := rendered("overlays/cpu-tiny")):
        if role in ("prefill", "decode"):
            conductor = container_env(objs, c)["TIDEKV_CONDUCTOR"]
            assert f"TIDEKV_CONDUCTOR={conductor}" in doc and f"`{conductor}` (`TIDEKV_CONDUCTOR`)" in doc


def test_deploy_doc_says_what_the_manifests_leave_off() -> None:
    # The doc says the servers authenticate every internal call (tests/security) and that the
    # manifests do not turn TLS on: a render that sets TLS must change that sentence.
    doc = " ".join(DEPLOY_DOC.read_text().split())
    assert "do not yet authenticate" not in doc and "The manifests do not turn TLS on" in doc
    for target in TARGETS:
        objs = rendered(target)
        for role, _, c in tidekv_containers(objs):
            env = container_env(objs, c)
            assert not {k for k in env if k.startswith("TIDEKV_TLS_")}, (target, role)
            # every member proves the cluster secret; the HTTP front signs nothing and holds none
            assert bool(env.get("TIDEKV_CLUSTER_SECRET_FILE")) == (role != "http"), (target, role)
