"""`python -m torchllm.ft [--section.key=value ...]`: fault_tolerance.bind, the run's default
lighthouse address and its label, three lines (scripts/ft_local.sh asks; ft/lighthouse.py)."""

from torchllm.ft.lighthouse import main
from torchllm.run.process_exit import exit_process

if __name__ == "__main__":
    exit_process(main())
