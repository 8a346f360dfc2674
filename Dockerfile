# syntax=docker/dockerfile:1
# The Tidekv image: one image for every role, `tidekv serve --role conductor|prefill|decode`.
# Settings come from TIDEKV_* environment variables (deploy/k8s/base/config/*.env) or flags.
#
#   docker build -t tidekv:0.1.0 .                                  CPU (the tiny model, cpu-tiny)
#   docker build -t tidekv:0.1.0-cuda --build-arg EXTRAS=ucx \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130 .   GPU nodes (gpu overlay)
#
# Two stages: the build stage compiles the gRPC modules and installs everything into a virtual
# environment; the runtime stage copies only that environment onto a clean base and runs as an
# unprivileged user, with nothing writable but the volumes the manifests mount.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
# torch is pinned to pyproject.toml's version (tests/deploy checks they agree). On this project's
# development machines `pip install torch==2.13.0` takes the CPU build from a wheel on local disk;
# an image build has no such file, and PyPI's default torch for Linux is the CUDA build (several
# GB), so the build stage asks PyTorch's CPU wheel index for it. A CUDA image names a CUDA index.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Optional extras of the distribution, comma-separated: "ucx" for the RDMA transfer backend.
ARG EXTRAS=""
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/tidekv
ENV PATH=/opt/tidekv/bin:$PATH
# Its own layer, first: the largest download changes least often.
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY . .
# The *_pb2 modules are build outputs (never committed): generate them here, so the installed
# package carries them and `tidekv` finds nothing stale to regenerate on a read-only filesystem.
# The import check runs isolated (-I: no working directory on sys.path), so it loads the
# installed package, not this source tree.
RUN pip install --no-cache-dir "grpcio-tools>=1.66" \
    && python -m proto.build --force \
    && pip install --no-cache-dir "/src${EXTRAS:+[${EXTRAS}]}" \
    && python -I -c "import conductor.server, prefill_worker.server, decode_worker.server, deploy.cli"

FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="tidekv" \
      org.opencontainers.image.description="Disaggregated KV-cache serving cluster for Kimi-Linear-style hybrid models" \
      org.opencontainers.image.licenses="Apache-2.0"
# A fixed uid/gid: the manifests run as 10001 (runAsUser, fsGroup) and need not trust the name.
RUN groupadd --system --gid 10001 tidekv \
    && useradd --system --uid 10001 --gid tidekv --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin tidekv \
    && install -d -o tidekv -g tidekv -m 0750 /var/lib/tidekv
COPY --from=build /opt/tidekv /opt/tidekv
# HOME and caches under /tmp: the root filesystem is read-only in the pods, /tmp is an emptyDir.
ENV PATH=/opt/tidekv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    MALLOC_ARENA_MAX=2
WORKDIR /var/lib/tidekv
USER 10001:10001
# gRPC: conductor 50051, workers 50061; Prometheus /metrics: 9400. The transfer engine listens on
# ephemeral ports.
EXPOSE 50051 50061 9400 8000
ENTRYPOINT ["tidekv", "serve"]
CMD ["--role", "conductor"]
