"""`python -m torchllm.hf export|import ...`: see torchllm.hf.cli."""

import sys

from torchllm.hf.cli import main

if __name__ == "__main__":
    sys.exit(main())
