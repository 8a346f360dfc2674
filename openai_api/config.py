"""The HTTP front's frozen config: ``tidekv serve --role http`` flags and ``TIDEKV_*`` variables.

Parsed by ``runtime.settings.parse_config`` like every role's config (a Kubernetes ConfigMap
sets ``TIDEKV_CONDUCTOR``, ``TIDEKV_PORT``...). The front holds no cluster secret: it signs
nothing, it only calls the Conductor's public ``Generate`` with the client's API key.

Limits (docs/api-http.md, "Limits"): a body over ``max_body_bytes`` is refused with 413 from
its Content-Length, or as soon as a chunked body passes it; ``max_json_depth`` bounds nesting
(400); the headers of a request must be complete ``header_timeout_s`` after the server starts
waiting for it, and its body ``body_timeout_s`` after the headers (408, then the connection is
closed); at most ``max_connections`` connections are open at once (the next ones get 503 and
are closed). The default body limit keeps every request the front accepts inside the
Conductor's gRPC message limit (``--max-request-bytes``, 8 MiB).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.tls import ServesConfig


@dataclass(frozen=True)
class FrontConfig(ServesConfig):
    conductor: str = field(default="", metadata={"help": "HOST:PORT of the Conductor's public gRPC endpoint, or "
                                                         "of its replicas comma-separated (required)"})
    host: str = field(default="127.0.0.1", metadata={"help": "address the HTTP server binds"})
    advertise_host: str = field(default="", metadata={"help": "address in the printed URL (default: --host, or "
                                                              "127.0.0.1 for 0.0.0.0)"})
    port: int = field(default=8000, metadata={"help": "HTTP port (0: a free one, printed)"})
    model: str = field(default="tiny", metadata={"help": "'tiny' or a checkpoint directory (tokenizer, chat "
                                                         "template, context length)"})
    served_model_name: str = field(default="", metadata={"help": "the model name clients send (default: --model)"})
    chat_template: str = field(default="", metadata={"help": "Jinja file overriding the model's chat template"})
    request_timeout_s: float = field(default=600.0, metadata={"help": "gRPC deadline of one Generate call"})
    default_max_tokens: int = field(default=16, metadata={"help": "completions without max_tokens"})
    default_chat_max_tokens: int = field(default=1024, metadata={"help": "chat without max_(completion_)tokens, "
                                                                         "capped by the context"})
    health_timeout_s: float = field(default=2.0, metadata={"help": "/ready's call of the Conductor's health"})
    api_keys: str = field(default="", metadata={"help": "the Conductor's API keys file (digests only): the front "
                                                        "refuses a request without a known key before reading "
                                                        "its body (401); without it, only the Conductor checks"})
    max_body_bytes: int = field(default=4 << 20, metadata={"help": "largest request body (413 beyond)"})
    max_json_depth: int = field(default=32, metadata={"help": "deepest nesting of a JSON body (400 beyond)"})
    header_timeout_s: float = field(default=10.0, metadata={"help": "a request's headers must be complete this "
                                                                    "long after the server waits for them (408)"})
    body_timeout_s: float = field(default=30.0, metadata={"help": "a request's body must be complete this long "
                                                                  "after its headers (408)"})
    keep_alive_s: int = field(default=5, metadata={"help": "an idle keep-alive connection is closed after this"})
    max_connections: int = field(default=1024, metadata={"help": "open connections at most (503 beyond)"})
    drain_timeout_s: float = field(default=30.0, metadata={"help": "SIGTERM: let open requests finish this long"})
    tls_cert: str = field(default="", metadata={"help": "PEM certificate: serve HTTPS (with --tls-key)"})
    tls_key: str = field(default="", metadata={"help": "PEM private key of --tls-cert"})
    tls_ca: str = field(default="", metadata={"help": "PEM CA: dial the Conductor over TLS, verified against it"})

    def __post_init__(self) -> None:
        bad = [a for a in self.conductors if ":" not in a]
        if bad:
            raise ValueError(f"--conductor must be HOST:PORT (or several, comma-separated), got {bad[0]!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.request_timeout_s <= 0 or self.default_max_tokens < 1 or self.default_chat_max_tokens < 1:
            raise ValueError("--request-timeout-s, --default-max-tokens and --default-chat-max-tokens must be > 0")
        if self.max_body_bytes < 1 or self.max_json_depth < 2 or self.max_connections < 1:
            raise ValueError(f"--max-body-bytes ({self.max_body_bytes}) and --max-connections "
                             f"({self.max_connections}) must be >= 1, --max-json-depth ({self.max_json_depth}) >= 2")
        if min(self.header_timeout_s, self.body_timeout_s, self.keep_alive_s, self.health_timeout_s) <= 0:
            raise ValueError("--header-timeout-s, --body-timeout-s, --keep-alive-s and --health-timeout-s "
                             "must be > 0")
        self.tls  # noqa: B018 - tls_cert without tls_key fails here, naming both

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def conductors(self) -> list[str]:
        """The Conductor replicas' addresses."""
        return [a.strip() for a in self.conductor.split(",") if a.strip()]

    def require_conductor(self) -> None:
        if not self.conductor:
            raise ValueError("--conductor (TIDEKV_CONDUCTOR) is required: HOST:PORT of the Conductor")


def config_from_args(argv: list[str] | None) -> FrontConfig:
    from runtime.settings import parse_config

    return parse_config(FrontConfig, argv, prog="tidekv serve --role http")
