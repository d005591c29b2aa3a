"""Hugging Face interop: export a checkpoint as a `transformers` folder (export.py; a LoRA run
also as a PEFT adapter, peft_names.py), import one as a seed checkpoint or a run's initial
weights (load.py), the tokenizer files of an export (tokenizer.py), and weights files
(convert.py). Commands: `python -m torchllm.hf export|import ...`, `python -m torchllm.hf.convert`.
"""
