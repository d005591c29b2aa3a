from torchllm.eval.harness.cli import main
from torchllm.process_exit import exit_process

exit_process(main())
