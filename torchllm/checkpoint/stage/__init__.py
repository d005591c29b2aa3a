"""Starting from another run's weights: the tokenizer a checkpoint's weights belong to, checked
by every reader (tokenizer_identity.py), and growing the vocabulary at a stage boundary
(vocab_resize.py). The initial load itself is chosen in resume/loading.py; Hugging Face weights
come in through torchllm/hf/load.py and fresh LoRA adapters through torchllm/models/lora.py."""
