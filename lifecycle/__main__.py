"""``python -m lifecycle``: the same command as ``lifecycle``."""

import sys

from lifecycle.cli import main

sys.exit(main())
