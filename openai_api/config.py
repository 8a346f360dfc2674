"""The HTTP front's frozen config and its command-line flags (``tidekv serve --role http``)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class FrontConfig:
    conductor: str                      # HOST:PORT of the Conductor's public gRPC endpoint
    host: str = "127.0.0.1"
    port: int = 8000                    # 0 picks a free port (printed at start)
    model: str = "tiny"                 # tokenizer, chat template and context length come from it
    served_model_name: str = ""         # the name clients send as ``model``; default: ``model``
    chat_template: str = ""             # a Jinja file overriding the model's template
    request_timeout_s: float = 600.0    # gRPC deadline of one Generate call
    default_max_tokens: int = 16        # completions without max_tokens (OpenAI's default)
    default_chat_max_tokens: int = 1024  # chat without max_(completion_)tokens, capped by the context
    health_timeout_s: float = 2.0       # /ready's call of the Conductor's health service
    tls_ca: str = ""                    # PEM CA: dial the Conductor over TLS, verified against it

    def __post_init__(self) -> None:
        if not self.conductor or ":" not in self.conductor:
            raise ValueError(f"--conductor must be HOST:PORT, got {self.conductor!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.request_timeout_s <= 0 or self.default_max_tokens < 1 or self.default_chat_max_tokens < 1:
            raise ValueError("--request-timeout-s, --default-max-tokens and --default-chat-max-tokens must be > 0")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser("tidekv serve --role http", description="OpenAI-compatible HTTP front")
    p.add_argument("--conductor", required=True, help="the Conductor's gRPC endpoint, HOST:PORT")
    p.add_argument("--host", default=FrontConfig.host)
    p.add_argument("--port", type=int, default=FrontConfig.port)
    p.add_argument("--model", default=FrontConfig.model, help="'tiny' or a checkpoint directory (tokenizer, "
                                                                "chat template, context length)")
    p.add_argument("--served-model-name", default="", help="the model name clients send (default: --model)")
    p.add_argument("--chat-template", default="", help="Jinja file overriding the model's chat template")
    p.add_argument("--request-timeout-s", type=float, default=FrontConfig.request_timeout_s)
    p.add_argument("--default-max-tokens", type=int, default=FrontConfig.default_max_tokens)
    p.add_argument("--default-chat-max-tokens", type=int, default=FrontConfig.default_chat_max_tokens)
    p.add_argument("--tls-ca", default="", help="PEM CA: dial the Conductor over TLS, verified against it")
    return p


def config_from_args(argv: list[str] | None) -> FrontConfig:
    a = build_parser().parse_args(argv)
    return FrontConfig(conductor=a.conductor, host=a.host, port=a.port, model=a.model,
                       served_model_name=a.served_model_name, chat_template=a.chat_template,
                       request_timeout_s=a.request_timeout_s, default_max_tokens=a.default_max_tokens,
                       default_chat_max_tokens=a.default_chat_max_tokens, tls_ca=a.tls_ca)
