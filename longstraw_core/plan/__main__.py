"""``python -m longstraw_core.plan``: see ``longstraw_core.plan.cli``."""

import sys

from longstraw_core.plan.cli import main

sys.exit(main())
