"""``python -m benchmarks.inspect_load``: see :mod:`benchmarks.inspect_load.run`."""

import sys

from benchmarks.inspect_load.run import main

if __name__ == "__main__":
    sys.exit(main())
