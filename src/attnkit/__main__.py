"""``python -m attnkit``: the ``attnkit`` command line (:mod:`attnkit.cli`)."""

import sys

from .cli import main

sys.exit(main())
