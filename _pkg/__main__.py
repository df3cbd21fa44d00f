"""`python -m mlxd ...` is the `mlxd` command (service files use it with an absolute
interpreter path)."""

import sys

from mlxd.cli.main import main

sys.exit(main())
