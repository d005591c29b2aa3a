"""A run's lifecycle: the launcher (`python -m torchllm.run`), the training process around the
Trainer, its folder and lock, stopping, failures and exit, and the run resolved once (tokenizer,
precision, folder) before the Trainer is built."""
