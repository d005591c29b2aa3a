"""`python -m torchllm.ft [--section.key=value ...]`: fault_tolerance.bind, the run's default
lighthouse address and its label, three lines (scripts/ft_local.sh asks; ft/lighthouse.py). It
runs no collective: a plain exit."""

import sys

from torchllm.ft.lighthouse import main

if __name__ == "__main__":
    sys.exit(main())
