"""``python -m gymserve.cli``: the same as the ``gymserve`` command."""

import sys

from gymserve.cli import main

sys.exit(main())
