"""``python -m attnkit``: the same command as ``attnkit``."""

import sys

from attnkit.cli import main

sys.exit(main())
