from torchllm.eval.harness.cli import main
from torchllm.run.process_exit import exit_process

if __name__ == "__main__":
    exit_process(main())
