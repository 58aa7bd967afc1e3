"""``python -m gymserve``: the same as the ``gymserve`` command (and ``python -m gymserve.cli``)."""

import sys

from gymserve.cli import main

if __name__ == "__main__":
    sys.exit(main())
