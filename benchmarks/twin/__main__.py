import sys

from benchmarks.twin.cli import main

sys.exit(main())
