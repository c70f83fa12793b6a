"""``python -m kvlens.cli``."""

import sys

from kvlens.cli import main

sys.exit(main())
