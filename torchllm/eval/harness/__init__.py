"""lm-evaluation-harness on torchllm checkpoints: `TorchllmLM` (model.py, an lm_eval model), the
CLI (cli.py, `python -m torchllm.eval.harness`), and where the shipped offline tasks in
torchllm/eval/harness_tasks/ read their rows (data.py). lm-eval is optional (the [harness]
extra): importing this package does not import it; model.py and the CLI's work do."""
