"""``python -m inference_worker``: dispatch to the subcommands registered in :mod:`inference_worker.cli`."""

import sys

from inference_worker.cli import main

if __name__ == "__main__":
    sys.exit(main())
