"""``python -m cli <command>``: the same as the ``omnirelay`` console script."""

import sys

from cli.main import main

# vLLM's engine processes are spawned and re-import the main module: start nothing on import.
if __name__ == "__main__":
    sys.exit(main())
