"""Generates the Python modules of every ``proto/*.proto`` file when they are missing or stale.

Run as ``python -m proto.build``; the install script calls it. Imports are rewritten to the
``proto.`` package so the generated modules import each other as ``proto.x_pb2``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent


def _stale(src: Path) -> bool:
    outs = [src.with_name(src.stem + "_pb2.py"), src.with_name(src.stem + "_pb2_grpc.py")]
    return any(not o.exists() or o.stat().st_mtime < src.stat().st_mtime for o in outs)


def build(force: bool = False) -> list[Path]:
    """Runs protoc over stale .proto files; returns the sources it compiled. Raises on failure."""
    import grpc_tools
    from grpc_tools import protoc  # build-time only

    include = Path(grpc_tools.__file__).parent / "_proto"
    sources = sorted(p for p in PROTO_DIR.glob("*.proto") if force or _stale(p))
    for src in sources:
        args = ["protoc", f"-I{PROTO_DIR}", f"-I{include}", f"--python_out={PROTO_DIR}",
                f"--grpc_python_out={PROTO_DIR}", f"--pyi_out={PROTO_DIR}", str(src)]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {src}")
    for gen in PROTO_DIR.glob("*_pb2*.py"):
        text = gen.read_text()
        fixed = re.sub(r"^import (\w+_pb2) as", r"from proto import \1 as", text, flags=re.M)
        if fixed != text:
            gen.write_text(fixed)
    return sources


if __name__ == "__main__":
    built = build(force="--force" in sys.argv)
    if built:
        print(f"proto: generated {len(built)} module(s)")
