"""`python -m torchllm.run [torchrun options] -- [--section.key=value ...]`: what run_train.sh
runs (torchllm/run/launch.py)."""

from torchllm.run.launch import main
from torchllm.run.process_exit import exit_process

if __name__ == "__main__":
    # Not sys.exit: finalizing an interpreter that imported torch takes ~0.5 s, and torchrun's
    # agent is done (workers reaped, store closed) when main() returns.
    exit_process(main())
