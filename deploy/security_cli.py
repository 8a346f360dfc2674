"""``tidekv secret``, ``tidekv certs`` and ``tidekv apikey``: make a cluster's credentials.

Thin shells over ``runtime.auth`` (the cluster secret), ``runtime.certs`` (a local CA and a
server certificate) and ``conductor.apikeys`` (API keys bound to tenants).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def _cmd_secret(args: argparse.Namespace) -> int:
    from runtime.auth import new_secret

    path = Path(args.out)
    if path.exists() and not args.force:
        raise ValueError(f"{path} exists; --force replaces it (every member must then get the new one)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(new_secret() + "\n")
    print(f"cluster secret written to {path} (mode 0600): give it to every process with "
          f"--cluster-secret-file {path}", file=sys.stderr)
    return 0


def _cmd_certs(args: argparse.Namespace) -> int:
    from runtime.certs import make_certs

    files = make_certs(args.out, args.host, args.days)
    print(f"CA {files.ca}; server certificate {files.cert} and key {files.key} for localhost, 127.0.0.1"
          f"{''.join(', ' + h for h in args.host)}\nserve with --tls-cert {files.cert} --tls-key {files.key}; "
          f"dial with --tls-ca {files.ca}", file=sys.stderr)
    return 0


def _cmd_apikey_add(args: argparse.Namespace) -> int:
    from conductor.admission import TenantLimits
    from conductor.apikeys import add_key

    given = (args.max_running, args.max_queued, args.weight) != (None, None, None)
    limits = TenantLimits(args.max_running, args.max_queued, 1.0 if args.weight is None else args.weight) \
        if given else None
    key = add_key(args.file, args.tenant, args.name, args.sub_tenant, limits)
    print(key)
    print(f"added a key for tenant {args.tenant!r} to {args.file}; it is shown only now (the file keeps its "
          f"SHA-256). Clients send it as 'authorization: Bearer <key>'.", file=sys.stderr)
    return 0


def add_security_parsers(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("secret", help="write a new cluster secret file (every member needs it)")
    s.add_argument("--out", required=True, metavar="FILE")
    s.add_argument("--force", action="store_true", help="replace an existing file")
    s.set_defaults(func=_cmd_secret)
    c = sub.add_parser("certs", help="make a local CA and a server certificate for the cluster's TLS")
    c.add_argument("--out", required=True, metavar="DIR")
    c.add_argument("--host", action="append", default=[], help="a host name or address the servers answer on "
                                                                "(repeat; localhost and 127.0.0.1 always)")
    c.add_argument("--days", type=int, default=365)
    c.set_defaults(func=_cmd_certs)
    a = sub.add_parser("apikey", help="manage the public endpoint's API keys")
    asub = a.add_subparsers(dest="apikey_command", required=True)
    add = asub.add_parser("add", help="add a key for a tenant to a keys file and print the key")
    add.add_argument("--file", required=True, help="the keys file the Conductor reads (--api-keys)")
    add.add_argument("--tenant", required=True)
    add.add_argument("--name", default="")
    add.add_argument("--sub-tenant", action="append", default=[], help="a further tenant the key may use (repeat)")
    add.add_argument("--max-running", type=int, default=None,
                     help="the tenant's most running requests (default: the Conductor's --max-running)")
    add.add_argument("--max-queued", type=int, default=None,
                     help="the tenant's most requests waiting for a slot (default: the Conductor's --max-queued)")
    add.add_argument("--weight", type=float, default=None,
                     help="the tenant's weight when tenants contend for slots (default 1); the limits apply to "
                          "every key of the tenant")
    add.set_defaults(func=_cmd_apikey_add)
