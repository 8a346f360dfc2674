"""Launchers and manifests: the ``tidekv`` command line, local process clusters, Ray, Kubernetes."""
