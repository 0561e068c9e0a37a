"""``python -m benchmarks.engine_attacks``: see :mod:`benchmarks.engine_attacks.run`."""

import sys

from benchmarks.engine_attacks.run import main

if __name__ == "__main__":
    sys.exit(main())
