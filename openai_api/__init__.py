"""The OpenAI-compatible HTTP front: ``tidekv serve --role http --conductor HOST:PORT``.

Design (decided; docs/api-http.md says more): the HTTP API is a separate process that maps
each HTTP request onto one call of the Conductor's public gRPC ``tidekv.v1.Inference/Generate``,
rather than a server inside the Conductor process.

- It scales on its own: JSON, SSE framing, detokenization and stop-string matching cost CPU
  per streamed token, and any number of fronts can sit before one Conductor (or a Service of
  Conductors) without taking cores from scheduling.
- It reuses exactly the same request lifecycle as gRPC: validation (the Conductor's
  ``INVALID_ARGUMENT`` message, which names the field, becomes a 400 naming the OpenAI
  field), admission (``RESOURCE_EXHAUSTED`` with trailing ``retry-after-s`` becomes a 429 with
  ``Retry-After``), routing, and later authentication (the ``Authorization`` header is
  forwarded as gRPC metadata; ``UNAUTHENTICATED`` becomes a 401).
- A client that goes away maps to a gRPC cancel, which the Conductor already turns into
  freeing the request's pages on both workers; a matched stop string does the same.

Modules: ``config`` (flags, frozen config), ``protocol`` (request bodies -> validated
parameters), ``chat_template`` (Jinja2 chat templates), ``textstream`` (incremental
detokenization, stop strings), ``generation`` (one gRPC Generate call as text pieces),
``render`` (OpenAI response and chunk shapes), ``errors`` (OpenAI error shape, gRPC status
mapping), ``server`` (the Starlette app and ``serve``).
"""
