"""`python -m mlxd ...` is the `mlxd` command (service files use it with an absolute
interpreter path)."""

import sys

from mlxd.daemon.cli import main

sys.exit(main())
