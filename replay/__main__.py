"""``python -m replay replay ...`` / ``python -m replay report compare A B``: the replay CLI
without the rest of ``tidekv`` (the same entries ``deploy/cli.py`` wires in)."""

import logging
import sys

from proto.build import build
from replay.cli import main

if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    build()  # the gRPC modules are build outputs: (re)generate them if missing or stale
    sys.exit(main())
