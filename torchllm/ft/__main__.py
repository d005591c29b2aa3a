"""`python -m torchllm.ft [--section.key=value ...]`: the run's default lighthouse address and its
label, two lines (scripts/ft_local.sh asks; torchllm/ft/lighthouse.py)."""

from torchllm.ft.lighthouse import main
from torchllm.run.process_exit import exit_process

if __name__ == "__main__":
    exit_process(main())
