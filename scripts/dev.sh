#!/usr/bin/env bash
# One entry point for a fresh clone: installs everything into .venv, then runs the demo or the tests.
#   bash scripts/dev.sh demo   install, then run the main job
#   bash scripts/dev.sh test   install (with test tools, the ucx extra and services), then run the whole test suite
#   bash scripts/dev.sh bench NAME [args]   install the benchmarks' peer baselines too, then run bench/NAME.py
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
venv="$root/.venv"
py=${PYTHON:-python3.11}
command -v "$py" >/dev/null 2>&1 || py=python3

need_debian() {
    # Installs Debian packages the tests use when they are missing (CI and a first run are root).
    local missing=()
    for pkg in "$@"; do dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg"); done
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ "$(id -u)" -ne 0 ]; then
        echo "dev.sh: please install Debian packages: ${missing[*]}" >&2
        return 1
    fi
    echo "dev.sh: apt-get install ${missing[*]}"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
}

install_venv() {
    local extras=$1
    [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
    local stamp="$venv/.tidekv-installed-$extras"
    local want
    want=$(cat pyproject.toml scripts/dev.sh | sha256sum | cut -c1-16)
    if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
        echo "dev.sh: installing into .venv ($extras)"
        "$venv/bin/pip" install -q --upgrade pip 2>/dev/null
        # torch first, pinned: its CPU build lies on the machine's disk.
        "$venv/bin/pip" install -q "torch==2.13.0" 2>&1 | grep -v "is ignored" || true
        "$venv/bin/pip" install -q -e ".[$extras]" 2>&1 | grep -v "is ignored" || true
        "$venv/bin/python" -c "import torch, grpc" # fail loudly if the install did not work
        echo "$want" >"$stamp"
    fi
    "$venv/bin/python" -m proto.build
}

case "${1:-}" in
    demo)
        install_venv test
        shift
        exec "$venv/bin/tidekv" demo "$@"
        ;;
    test)
        need_debian redis-server redis-sentinel prometheus
        # ucx: ucxx-cu12 runs here without a GPU (UCX over tcp on loopback), so every ucx test runs
        install_venv test,ucx
        shift
        "$venv/bin/ruff" check .
        exec "$venv/bin/python" -m pytest "$@"
        ;;
    bench)
        [ $# -ge 2 ] || { echo "usage: bash scripts/dev.sh bench NAME [args] (NAME: a module of bench/)" >&2; exit 2; }
        # libibverbs1: Mooncake's transfer engine (bench.transfer and bench.store's peer) loads it, RDMA or not
        need_debian redis-server libibverbs1
        install_venv test,ucx,bench
        # Dynamo's offline trace replay, bench.simulate's baseline: its wheels declare GPU serving
        # dependencies the replay does not use, hence --no-deps
        "$venv/bin/python" -c "import dynamo.replay.api" 2>/dev/null || {
            echo "dev.sh: installing Dynamo's replay (ai-dynamo 1.6.1, --no-deps)"
            "$venv/bin/pip" install -q --no-deps "ai-dynamo==1.6.1" "ai-dynamo-runtime==1.6.1" 2>&1 | grep -v "is ignored" || true
        }
        name=$2
        shift 2
        exec "$venv/bin/python" -m "bench.$name" "$@"
        ;;
    *)
        echo "usage: bash scripts/dev.sh demo|test|bench [args]" >&2
        exit 2
        ;;
esac
