"""Shared test builders (tests/builders/chat.py): imported by the test modules that use them."""

from __future__ import annotations

import json

from conftest import shared_path, tiny_config


# Written like the published ones (Llama 3 Instruct, Qwen3), trimmed to what matters here.
LLAMA3_LIKE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
    "message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)


QWEN3_LIKE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


# transformers' assistant-mask markers: rendered as their body (the mask comes from prefixes).
QWEN3_GENERATION = QWEN3_LIKE.replace(
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}",
    "{{- '<|im_start|>' + message.role + '\\n' }}{%- if message.role == 'assistant' %}"
    "{% generation %}{{- message.content + '<|im_end|>' }}{% endgeneration %}{%- else %}"
    "{{- message.content + '<|im_end|>' }}{%- endif %}{{- '\\n' }}")


TEMPLATES = {
    "llama3": (LLAMA3_LIKE, ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                             "<|end_header_id|>", "<|eot_id|>"], "<|begin_of_text|>", "<|eot_id|>"),
    "qwen3": (QWEN3_LIKE, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|endoftext|>",
              "<|im_end|>"),
    "qwen3-generation": (QWEN3_GENERATION, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                         "<|endoftext|>", "<|im_end|>"),
}


def tokenizer_folder(tmp_path, kind: str, pattern: str | None = None):
    """GPT-2's BPE as a tokenizer.json with the family's special tokens and its template
    (`pattern`: another pre-tokenization regex than GPT-2's)."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from torchllm.data.tokenizer import GPT2_PATTERN

    template, specials, bos, eos = TEMPLATES[kind]
    ranks = shared_path("tokenizers", "gpt2", "gpt2.tiktoken")
    TikTokenConverter(vocab_file=str(ranks), pattern=pattern or GPT2_PATTERN,
                      extra_special_tokens=specials).converted().save(
        str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": bos, "eos_token": eos, "chat_template": template,
         "tokenizer_class": "PreTrainedTokenizerFast"}))
    return tmp_path


def write_chat(path, convs):
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    return path
