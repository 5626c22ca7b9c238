"""``python -m lifecycle``: the same command as ``lifecycle``."""

import os
import sys

from lifecycle.cli import main

# `python -m` puts the working directory first on sys.path. The project's own packages
# are imported by now; what loads later (plugins, by entry point) must come from
# installed packages, never from a file lying in the working directory.
if not sys.flags.safe_path and sys.path and sys.path[0] in ("", os.getcwd()):
    del sys.path[0]

sys.exit(main())
