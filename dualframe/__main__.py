"""``python -m dualframe``: the command line."""
from dualframe.cli import main

raise SystemExit(main())
