"""``python -m argus``: the ``argus`` command line (:func:`argus.cli.main`), e.g. where the console script is
not on ``PATH``."""

import sys

from argus.cli import main

if __name__ == "__main__":
    sys.exit(main())
