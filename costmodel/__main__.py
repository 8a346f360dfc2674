"""``python -m costmodel``: ``tidekv calibrate`` without the rest of the CLI (same flags)."""

import sys

from costmodel.cli import main

sys.exit(main())
