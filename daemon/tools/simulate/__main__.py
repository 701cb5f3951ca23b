"""``python -m daemon.tools.simulate``: the same as ``lpcal simulate``."""

import sys

from daemon.tools.simulate.cli import main

sys.exit(main())
