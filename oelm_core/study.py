"""``python -m oelm_core.study PLAN``: the older name of ``python -m oelm_core run PLAN``."""

import sys

from oelm_core.runner.cli import main

if __name__ == "__main__":
    print("python -m oelm_core.study is now python -m oelm_core run", file=sys.stderr, flush=True)
    sys.exit(main(prog="python -m oelm_core.study"))
