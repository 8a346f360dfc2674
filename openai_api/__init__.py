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
  ``Retry-After``), routing and authentication (the ``Authorization`` header is forwarded as
  gRPC metadata; ``UNAUTHENTICATED`` becomes a 401). Given the keys file, the front also
  refuses a request without a known key before it reads the body.
- It is the cluster's public HTTP face, so it bounds what a client can make it hold: body
  size, JSON nesting, header and body deadlines, open connections. It holds no cluster
  secret: it signs nothing.
- A client that goes away maps to a gRPC cancel, which the Conductor already turns into
  freeing the request's pages on both workers; a matched stop string does the same.

Modules: ``config`` (flags, frozen config), ``keys`` (API keys, before the body), ``body``
(size, time and nesting limits of a body), ``protocol`` (request bodies -> validated
parameters), ``chat_template`` (Jinja2 chat templates), ``textstream`` (incremental
detokenization, stop strings), ``generation`` (one gRPC Generate call as text pieces),
``render`` (OpenAI response and chunk shapes), ``errors`` (OpenAI error shape, gRPC status
mapping), ``metrics`` (the front's Prometheus metrics), ``connections`` (connection cap and
header deadline), ``server`` (the Starlette app), ``service`` (uvicorn around it, ``serve``).
"""
