"""``python -m backplane.cli``: the same as the ``backplane`` console script."""

import sys

from backplane.cli import main

sys.exit(main())
