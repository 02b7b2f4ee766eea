"""``python -m rematd.cli``: the ``rematd`` command."""

import sys

from rematd.cli import main

sys.exit(main())
