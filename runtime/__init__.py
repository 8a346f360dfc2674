"""Process plumbing every Tidekv server uses: the gRPC server (bind, health, reflection,
drain), the worker's registry link to the Conductor, and the one place that reads
``TIDEKV_*`` environment variables and parses a component's frozen config.

``deploy/`` (launchers and manifests) builds on this package; no server imports ``deploy``.
"""
