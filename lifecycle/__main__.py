"""``python -m lifecycle``: the same command as ``lifecycle``."""

import os
import sys

from lifecycle.cli.entry import main

# `python -m` puts the working directory first on sys.path. Only the `lifecycle` package
# is imported by now (its names load on first use): the rest of the house, the libraries
# and plugins (by entry point) load later, from installed packages, never from a file
# lying in the working directory.
if not sys.flags.safe_path and sys.path and sys.path[0] in ("", os.getcwd()):
    del sys.path[0]

sys.exit(main())
