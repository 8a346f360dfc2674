"""Offline checks of each workload of the Kubernetes manifests (deploy/k8s) on its own.

The checks no schema can make about one pod, each a function returning a list of problems (empty
when the render is sound), run on every kustomization: probes, requests and limits and a
locked-down security context on every container; bounded volumes that exist; a grace period
that covers the preStop sleep and the drain; TIDEKV_* settings that agree with the manifests
(ports, Service addresses, tier sizes within their memory and volume); the labels; and a
parallel instance's ranks in one pod with a GPU each and a memory-backed /dev/shm. Then a test
breaks a render on purpose to show that each check does fail.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from tests.deploy.k8s_support import (
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

# ---- sizes in a render ----------------------------------------------------------------------------

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
    check_containers, check_volumes, check_grace_periods, check_settings, check_labels, check_parallel_instances,
]


# ---- tests ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_structure(objs: list[dict], check: Callable[[list[dict]], list[str]]) -> None:
    assert check(objs) == []


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
    "grace period too short": ("overlays/gpu", lambda o: _template_spec(o, "Deployment", "tidekv-decode").update(
        terminationGracePeriodSeconds=100), check_grace_periods),
    "SSD tier beyond its volume": ("overlays/gpu", lambda o: _set_env(o, "prefill", "TIDEKV_SSD_BYTES", str(1 << 50)),
                                   check_settings),
    "wrong conductor address": ("overlays/cpu-tiny", lambda o: _set_env(o, "decode", "TIDEKV_CONDUCTOR",
                                                                        "tidekv-conductor:1"), check_settings),
    "pod without a role label": ("overlays/cpu-tiny", lambda o: _find(o, "Deployment", "tidekv-decode")["spec"][
        "template"]["metadata"]["labels"].pop("tidekv.io/role"), check_labels),
    "one GPU for two ranks": ("overlays/gpu-tp", lambda o: _container(o, "prefill")["resources"]["limits"].update(
        {"nvidia.com/gpu": "1"}), check_parallel_instances),
    "NCCL without /dev/shm": ("overlays/gpu-tp", lambda o: _container(o, "decode").update(volumeMounts=[
        m for m in _container(o, "decode")["volumeMounts"] if m["mountPath"] != "/dev/shm"]), check_parallel_instances),
}


@pytest.mark.parametrize("name", MUTATIONS)
def test_checks_catch_a_broken_render(name: str) -> None:
    target, mutate, check = MUTATIONS[name]
    objs = rendered(target)
    assert check(objs) == []
    mutate(objs)
    assert check(objs) != [], f"{check.__name__} missed: {name}"
