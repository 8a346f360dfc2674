"""The Conductor: Tidekv's global scheduler and public gRPC endpoint. It owns the request
lifecycle, admission and routing; routing policies are pure functions (``routing``,
``policies``) that the server applies."""
