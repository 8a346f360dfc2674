"""``ConductorConfig``: every setting of the Conductor, frozen, defaults written once here.

Parsed by ``runtime.settings.parse_config`` from argv and ``TIDEKV_*`` variables. Parts of it
are handed on as smaller frozen values: ``routing`` (what a policy factory reads), ``slos``
(cluster and per-tenant SLO defaults), ``limits`` (request validation) and ``admission``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from conductor.admission import AdmissionConfig
from conductor.routing_config import ADMISSION_MODES, RoutingConfig
from conductor.validation import Limits
from runtime.tls import TlsFiles

MAX_METRICS_TENANTS = 50  # each allowed tenant multiplies the per-tenant series


def _policy_names() -> list[str]:
    from conductor.routing import policy_names

    return policy_names()


@dataclass(frozen=True)
class SLO:
    """Time-to-first-token and time-between-tokens targets (TBT as in Mooncake: the mean of a
    request's slowest 10% of token intervals). Seconds; both > 0."""

    ttft_s: float
    tbt_s: float

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tbt_s > 0):
            raise ValueError(f"SLOs must be > 0: ttft_s {self.ttft_s}, tbt_s {self.tbt_s}")


@dataclass(frozen=True)
class SLOTable:
    """Cluster default and per-tenant SLOs; a request may tighten or relax its own."""

    default: SLO
    by_tenant: tuple[tuple[str, SLO], ...] = ()

    def resolve(self, tenant: str, ttft_s: float = 0.0, tbt_s: float = 0.0) -> SLO:
        """The request's value where given (> 0), else its tenant's, else the cluster's."""
        base = dict(self.by_tenant).get(tenant, self.default)
        return SLO(ttft_s or base.ttft_s, tbt_s or base.tbt_s)


def parse_tenant_slos(entries: tuple[str, ...]) -> tuple[tuple[str, SLO], ...]:
    """``("acme=2.5/0.1", ...)`` -> ``(("acme", SLO(2.5, 0.1)), ...)``; ValueError naming the entry."""
    out = []
    for entry in entries:
        tenant, sep, values = entry.partition("=")
        ttft, slash, tbt = values.partition("/")
        try:
            if not (tenant and sep and slash):
                raise ValueError("expected TENANT=TTFT_S/TBT_S")
            out.append((tenant, SLO(float(ttft), float(tbt))))
        except ValueError as e:
            raise ValueError(f"tenant_slos entry {entry!r}: {e}") from e
    return tuple(out)


R = RoutingConfig  # the routing defaults, written once there


@dataclass(frozen=True)
class ConductorConfig:
    model: str = field(default="tiny", metadata={"help": "model whose config and tokenizer the Conductor uses"})
    host: str = field(default="127.0.0.1", metadata={"help": "address the gRPC server binds"})
    port: int = field(default=50051, metadata={"help": "public and registry gRPC port"})
    # 0 by default: a local cluster runs every process on one host (a fixed port would collide)
    # and prints each address; the Kubernetes manifests set 9400 for their scrape config.
    metrics_port: int = field(default=0, metadata={"help": "Prometheus /metrics port on --host "
                                                           "(0: a free one, -1: no metrics endpoint)"})
    metrics_tenants: tuple[str, ...] = field(default=(), metadata={
        "help": "tenants that get their own metrics label value (others are counted as 'other')"})
    policy: str = field(default="mooncake", metadata={"help": "routing policy", "choices": _policy_names})
    index: str = field(default="memory", metadata={
        "help": "where the cluster state lives: memory (this Conductor only), or a store that Conductor replicas "
                "share: redis://HOST:PORT[/DB], rediss://... (TLS) or redis+sentinel://HOST:PORT[,...]/SERVICE"})
    index_password_file: str = field(default="", metadata={"help": "file with the store's password (AUTH; a user "
                                                                   "goes in the URL: redis://USER@HOST:PORT)"})
    index_tls_ca: str = field(default="", metadata={"help": "PEM CA that a rediss:// store's certificate is "
                                                            "verified against (default: the system's)"})
    index_namespace: str = field(default="tidekv", metadata={"help": "prefix of every key in the store"})
    max_index_lag_s: float = field(default=5.0, metadata={
        "help": "a replica whose state is further behind the store's log than this is not ready"})
    calibration: str = field(default="", metadata={"help": "cost-model file from `tidekv calibrate` "
                                                           "(needed by mooncake; default: the built-in estimate)"})
    worker_ttl_s: float = field(default=3.0, metadata={"help": "a worker silent this long is dropped"})
    heartbeat_interval_s: float = field(default=0.5, metadata={"help": "how often workers report their load"})
    max_running: int = field(default=16, metadata={"help": "requests in flight at once"})
    max_queued: int = field(default=64, metadata={"help": "requests waiting for a running slot"})
    max_queue_wait_s: float = field(default=30.0, metadata={"help": "longest wait for a running slot "
                                                                    "(or the request's deadline if sooner)"})
    max_prompt_tokens: int = field(default=8000, metadata={"help": "longest prompt accepted"})
    max_new_tokens: int = field(default=1024, metadata={"help": "most tokens one request may generate"})
    ttft_slo_s: float = field(default=10.0, metadata={"help": "cluster default time-to-first-token SLO"})
    tbt_slo_s: float = field(default=0.25, metadata={"help": "cluster default time-between-tokens SLO"})
    tenant_slos: tuple[str, ...] = field(default=(), metadata={"help": "per-tenant SLOs: TENANT=TTFT_S/TBT_S,..."})
    max_prefill_attempts: int = field(default=2, metadata={"help": "tries of a prefill that fails before "
                                                                   "anything reached the client"})
    # 60 s: well above the longest prompt's prefill behind a usual queue on one CPU worker, so
    # it catches a worker that stopped, not one that is busy; a predicting policy (mooncake)
    # raises it to 4x its predicted TTFT, queue included (conductor.dispatch.prefill_timeout_s).
    # Under a policy that predicts nothing, queues deeper than this need a higher floor.
    prefill_timeout_s: float = field(default=60.0, metadata={
        "help": "a prefill attempt unanswered for max(this, 4x the predicted TTFT) is cancelled as stalled "
                "and retried on another worker (0: only the request's deadline bounds it)"})
    reservation_renew_s: float = field(default=5.0, metadata={
        "help": "how often the decode reservations this Conductor holds (from a Reserve to its Decode call) "
                "are renewed, at most a third of the decode worker's TTL (0: never; each then lives for the "
                "TTL after its Reserve or its last KV)"})
    decode_stall_timeout_s: float = field(default=30.0, metadata={
        "help": "a decode stream that sends no token for this long (a hung worker) is cancelled and the request "
                "migrates (0: only the request's deadline bounds it)"})
    max_decode_migrations: int = field(default=2, metadata={
        "help": "times a request whose decode worker is lost mid-stream moves to another decode worker "
                "(prefilling prompt + the tokens sent) before it fails"})
    admission_mode: str = field(default=R.admission_mode, metadata={
        "help": "mooncake decode admission: predictive (load when the request reaches decode), early "
                "(load now), none", "choices": lambda: ADMISSION_MODES})
    balancing_threshold: float = field(default=R.balancing_threshold, metadata={
        "help": "mooncake: consider pulling a prefix when it is this many times longer than the local one"})
    hot_prefix_rate_per_s: float = field(default=R.hot_prefix_rate_per_s, metadata={
        "help": "mooncake: a prefix used more often than this is hot and may be replicated"})
    max_replicas: int = field(default=R.max_replicas, metadata={"help": "most prefill workers holding one hot prefix"})
    cache_aware_abs_threshold: int = field(default=R.cache_aware_abs_threshold, metadata={
        "help": "cache_aware: balance load when the busiest worker has this many more requests than the idlest"})
    cache_aware_rel_threshold: float = field(default=R.cache_aware_rel_threshold, metadata={
        "help": "cache_aware: ... and this many times as many"})
    kv_cost_overlap_weight: float = field(default=R.kv_cost_overlap_weight, metadata={
        "help": "kv_cost: weight of prefill blocks"})
    kv_cost_temperature: float = field(default=R.kv_cost_temperature, metadata={
        "help": "kv_cost: softmax temperature (0: argmin)"})
    policy_seed: int = field(default=R.seed, metadata={"help": "seed of the random and sampled policies"})
    pull_from_peers: bool = field(default=R.pull_from_peers, metadata={
        "help": "let a prefill worker pull a deeper prefix from another worker (off: local reuse only)"})
    drain_timeout_s: float = field(default=30.0, metadata={"help": "SIGTERM: finish in-flight requests this long"})
    api_keys: str = field(default="", metadata={"help": "JSON file of API key digests and their tenants "
                                                        "(`tidekv apikey add`); reloaded when it changes"})
    insecure_no_auth: bool = field(default=False, metadata={
        "help": "serve the public endpoint WITHOUT API keys, trusting each request's tenant (demos only)"})
    cluster_secret_file: str = field(default="", metadata={"help": "file with the secret every cluster member "
                                                                   "shares (required; `tidekv secret --out FILE`)"})
    tls_cert: str = field(default="", metadata={"help": "PEM certificate: serve gRPC over TLS (with --tls-key)"})
    tls_key: str = field(default="", metadata={"help": "PEM private key of --tls-cert"})
    tls_ca: str = field(default="", metadata={"help": "PEM CA: dial workers over TLS, verified against it"})
    max_request_bytes: int = field(default=8 << 20, metadata={
        "help": "largest gRPC message accepted (gRPC refuses a larger one before reading it)"})
    max_prompt_bytes: int = field(default=1 << 20, metadata={"help": "longest prompt text in UTF-8 bytes, "
                                                                     "checked before tokenization"})

    def __post_init__(self) -> None:
        if self.worker_ttl_s <= self.heartbeat_interval_s or self.heartbeat_interval_s <= 0:
            raise ValueError(f"need 0 < heartbeat_interval_s ({self.heartbeat_interval_s}) "
                             f"< worker_ttl_s ({self.worker_ttl_s})")
        if self.max_prefill_attempts < 1:
            raise ValueError(f"max_prefill_attempts {self.max_prefill_attempts} < 1")
        if self.reservation_renew_s < 0:
            raise ValueError(f"reservation_renew_s {self.reservation_renew_s} must be >= 0")
        if self.prefill_timeout_s < 0 or self.max_decode_migrations < 0 or self.decode_stall_timeout_s < 0:
            raise ValueError(f"prefill_timeout_s {self.prefill_timeout_s}, decode_stall_timeout_s "
                             f"{self.decode_stall_timeout_s} and max_decode_migrations "
                             f"{self.max_decode_migrations} must be >= 0")
        if self.max_index_lag_s <= 0:
            raise ValueError(f"max_index_lag_s {self.max_index_lag_s} must be > 0")
        if self.max_queue_wait_s < 0:
            raise ValueError(f"max_queue_wait_s {self.max_queue_wait_s} < 0")
        if not -1 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port {self.metrics_port} not in -1..65535 (-1: off, 0: a free port)")
        if len(self.metrics_tenants) > MAX_METRICS_TENANTS:
            raise ValueError(f"metrics_tenants lists {len(self.metrics_tenants)} tenants; at most "
                             f"{MAX_METRICS_TENANTS} keep the tenant label bounded")
        if self.api_keys and self.insecure_no_auth:
            raise ValueError("api_keys and insecure_no_auth contradict each other: give one")
        if not 0 < self.max_prompt_bytes < self.max_request_bytes:
            raise ValueError(f"need 0 < max_prompt_bytes ({self.max_prompt_bytes}) "
                             f"< max_request_bytes ({self.max_request_bytes})")
        self.tls  # noqa: B018
        self.slos  # noqa: B018 - parse the SLOs now: a bad entry fails at start, naming it
        self.routing  # noqa: B018
        self.admission  # noqa: B018

    @property
    def slos(self) -> SLOTable:
        return SLOTable(SLO(self.ttft_slo_s, self.tbt_slo_s), parse_tenant_slos(self.tenant_slos))

    @property
    def routing(self) -> RoutingConfig:
        return RoutingConfig(
            admission_mode=self.admission_mode, balancing_threshold=self.balancing_threshold,
            hot_prefix_rate_per_s=self.hot_prefix_rate_per_s, max_replicas=self.max_replicas,
            cache_aware_abs_threshold=self.cache_aware_abs_threshold,
            cache_aware_rel_threshold=self.cache_aware_rel_threshold,
            kv_cost_overlap_weight=self.kv_cost_overlap_weight, kv_cost_temperature=self.kv_cost_temperature,
            seed=self.policy_seed, pull_from_peers=self.pull_from_peers,
        )

    @property
    def limits(self) -> Limits:
        return Limits(max_prompt_tokens=self.max_prompt_tokens, max_new_tokens=self.max_new_tokens,
                      max_prompt_bytes=self.max_prompt_bytes)

    @property
    def tls(self) -> TlsFiles:
        return TlsFiles(self.tls_cert, self.tls_key, self.tls_ca)

    @property
    def admission(self) -> AdmissionConfig:
        return AdmissionConfig(self.max_running, self.max_queued)
