"""``python -m openai_api --conductor HOST:PORT [--port N]``: the same as ``tidekv serve --role http``."""

import sys

from openai_api.service import serve

if __name__ == "__main__":
    serve(sys.argv[1:])
