"""``python -m attnkit.cli ...`` runs the same command line as the ``attnkit`` script."""

import sys

from . import main

sys.exit(main())
