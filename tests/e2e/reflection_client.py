"""A client of the public API that knows it only through gRPC server reflection.

It imports none of Tidekv's generated modules: the service, its method and the message types
come from the Conductor's reflection service (``grpc.reflection.v1alpha``) into a descriptor
pool of its own, requests are built from field names (``json_format.ParseDict``) and the
stream is read as dynamic messages, as a client in another language or `grpcurl` would.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

SERVICE, METHOD = "tidekv.v1.Inference", "Generate"


class ReflectionClient:
    def __init__(self, endpoint: str):
        self.channel = grpc.insecure_channel(endpoint)
        database = ProtoReflectionDescriptorDatabase(self.channel)
        self.services = tuple(database.get_services())
        pool = descriptor_pool.DescriptorPool(database)
        method = pool.FindServiceByName(SERVICE).FindMethodByName(METHOD)
        self._request = message_factory.GetMessageClass(method.input_type)
        response = message_factory.GetMessageClass(method.output_type)
        self._generate = self.channel.unary_stream(f"/{SERVICE}/{METHOD}",
                                                   request_serializer=self._request.SerializeToString,
                                                   response_deserializer=response.FromString)
        finish = pool.FindEnumTypeByName("tidekv.v1.FinishReason")
        self.finish_reason = {v.number: v.name for v in finish.values}

    def close(self) -> None:
        self.channel.close()

    def request(self, token_ids: list[int], max_tokens: int, **sampling: Any):
        """A GenerateRequest from field names: prompt token ids and sampling fields."""
        body = {"token_ids": {"ids": list(token_ids)}, "sampling": {"max_tokens": max_tokens, **sampling}}
        return json_format.ParseDict(body, self._request())

    def request_text(self, text: str, max_tokens: int, **sampling: Any):
        """A GenerateRequest with a text prompt (the Conductor tokenizes it)."""
        body = {"text": text, "sampling": {"max_tokens": max_tokens, **sampling}}
        return json_format.ParseDict(body, self._request())

    def stream(self, request, timeout_s: float = 300.0) -> Iterator:
        """The response messages as they arrive."""
        return self._generate(request, timeout=timeout_s)

    def generate(self, request, timeout_s: float = 300.0) -> dict[str, Any]:
        """The whole stream folded into a dict: every token, the one finish reason (by name), the
        first message's placement and usage."""
        msgs = list(self.stream(request, timeout_s))
        return fold(msgs, self.finish_reason)


def fold(msgs: list, finish_reason: dict[int, str]) -> dict[str, Any]:
    first = msgs[0] if msgs else None
    return {
        "token_ids": [t for m in msgs for t in m.token_ids],
        "text": "".join(m.text for m in msgs),
        "finish_reasons": [finish_reason[m.finish_reason] for m in msgs if m.finish_reason],
        "error": msgs[-1].error if msgs else "",
        "prefill_worker": first.prefill_worker if first else "",
        "decode_workers": [m.decode_worker for m in msgs if m.decode_worker],
        "pulled_from": first.pulled_from if first else "",
        "cached_tokens": first.usage.cached_tokens if first else 0,
    }
