"""`python -m labkit.bench --worker NAME SPEC`: one timed side of a comparison, in its own process."""

import sys

from labkit.bench.workers import worker_main

if len(sys.argv) == 4 and sys.argv[1] == "--worker":
    worker_main(sys.argv[2], sys.argv[3])
else:
    raise SystemExit("usage: python -m labkit bench [options]")
