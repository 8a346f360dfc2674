"""``WorkerConfig``: the settings every worker role shares (each role's config extends it).

Parsed by ``runtime.settings.parse_config`` from argv and ``TIDEKV_*`` variables.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine import DEFAULT_BLOCK_SIZE
from engine.parallel.shape import ParallelShape
from runtime.tls import ServesConfig

TRANSFER_BACKENDS = ("tcp", "shm", "ucx")


@dataclass(frozen=True)
class WorkerConfig(ServesConfig):
    conductor: str = field(default="", metadata={"help": "host:port of the Conductor, or of its replicas "
                                                         "comma-separated (required)"})
    model: str = field(default="tiny", metadata={"help": "'tiny' or a checkpoint directory"})
    host: str = field(default="127.0.0.1", metadata={"help": "address the gRPC and transfer servers bind"})
    advertise_host: str = field(default="", metadata={"help": "address registered with the Conductor "
                                                              "(default: --host, or 127.0.0.1 for 0.0.0.0)"})
    port: int = field(default=0, metadata={"help": "gRPC port (0: a free one)"})
    # 0 by default: several local processes share one host, so each takes a free port and
    # prints it; the Kubernetes manifests set 9400 (one process per pod, a fixed scrape port).
    metrics_port: int = field(default=0, metadata={"help": "Prometheus /metrics port on --host "
                                                           "(0: a free one, -1: no metrics endpoint)"})
    worker_id: str = field(default="", metadata={"help": "stable id (default: role plus a random suffix)"})
    num_pages: int = field(default=1024, metadata={"help": "MLA cache pages in the engine's pool"})
    block_size: int = field(default=DEFAULT_BLOCK_SIZE, metadata={"help": "tokens per page and per block"})
    transfer_backend: str = field(default="tcp", metadata={"help": "KV transfer backend",
                                                           "choices": lambda: TRANSFER_BACKENDS})
    device: str = field(default="cpu", metadata={"help": "cpu or cuda[:N]"})
    threads: int = field(default=0, metadata={"help": "torch threads (0: TIDEKV_TORCH_THREADS, default 1)"})
    drain_timeout_s: float = field(default=30.0, metadata={"help": "SIGTERM: finish held requests for this long"})
    warmup: bool = field(default=True, metadata={"help": "run a prefill and decode steps on a scratch cache "
                                                         "before registering, so the first request is not slower"})
    cluster_secret_file: str = field(default="", metadata={"help": "file with the secret every cluster member "
                                                                   "shares (required; `tidekv secret --out FILE`)"})
    tls_cert: str = field(default="", metadata={"help": "PEM certificate: serve gRPC over TLS (with --tls-key)"})
    tls_key: str = field(default="", metadata={"help": "PEM private key of --tls-cert"})
    tls_ca: str = field(default="", metadata={"help": "PEM CA: dial the Conductor and peers over TLS, verified"})
    # One instance over several ranks (engine.parallel, runtime.ranks): rank 0 is the instance.
    tp: int = field(default=1, metadata={"help": "tensor-parallel ranks of this instance (heads, MLP columns, "
                                                 "vocabulary split over them)"})
    ep: int = field(default=1, metadata={"help": "expert-parallel ranks (routed experts split over them; "
                                                 "composes with --tp: tp*ep ranks)"})
    rank: int = field(default=0, metadata={"help": "this process's rank in its instance (0: the instance's gRPC "
                                                   "face, which registers it; the others follow its schedule)"})
    dist_init: str = field(default="", metadata={
        "help": "rendezvous of the instance's ranks: tcp://HOST:PORT, rank 0 hosting it, every rank started by its "
                "launcher; '' (default): rank 0 starts the other ranks on this host itself"})
    dist_timeout_s: float = field(default=600.0, metadata={"help": "longest wait for the ranks to meet, and for "
                                                                   "one collective"})

    def __post_init__(self) -> None:
        if self.num_pages < 1 or self.block_size < 1:
            raise ValueError(f"num_pages {self.num_pages} and block_size {self.block_size} must be >= 1")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port {self.port} not in 0..65535")
        if not -1 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port {self.metrics_port} not in -1..65535 (-1: off, 0: a free port)")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s {self.drain_timeout_s} < 0")
        self.tls  # noqa: B018 - tls_cert without tls_key fails here, naming both
        self.parallel_shape.coords(self.rank)  # a bad shape or a rank outside it fails here, naming it
        if self.dist_init and not self.dist_init.startswith(("tcp://", "file://")):
            raise ValueError(f"dist_init {self.dist_init!r}: expected tcp://HOST:PORT or file:///PATH")

    @property
    def parallel_shape(self) -> ParallelShape:
        """The instance's ranks: tp x ep (x pipeline stages for a prefill instance)."""
        return ParallelShape(self.tp, self.ep, getattr(self, "cpp_stages", 1))

    def require_conductor(self) -> None:
        if not self.conductor:
            raise ValueError("--conductor (TIDEKV_CONDUCTOR) is required: host:port of the Conductor")
