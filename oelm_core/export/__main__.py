"""``python -m oelm_core.export``: the CLI (``oelm_core.export.main``), the same command as
``python -m oelm_core export``."""

import sys

from oelm_core.export import main

if __name__ == "__main__":
    sys.exit(main())
