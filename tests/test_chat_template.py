"""A tokenizer's own Jinja chat template: conversations render as transformers'
`apply_chat_template` renders them, and the loss mask covers exactly the assistant turns
(their content and end-of-turn token)."""

from __future__ import annotations

import json

import pytest

from torchllm.data import build_tokenizer, load_tokenizer
from torchllm.data.chat import ChatTemplate, ChatTokenizer

from conftest import shared_path, tiny_config

CONV = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4, of course."},
    {"role": "user", "content": "And 3 + 3?"},
    {"role": "assistant", "content": "6.\nDone"},
]

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
assert QWEN3_GENERATION != QWEN3_LIKE
TEMPLATES = {
    "llama3": (LLAMA3_LIKE, ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                             "<|end_header_id|>", "<|eot_id|>"], "<|begin_of_text|>", "<|eot_id|>"),
    "qwen3": (QWEN3_LIKE, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|endoftext|>",
              "<|im_end|>"),
    "qwen3-generation": (QWEN3_GENERATION, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                         "<|endoftext|>", "<|im_end|>"),
}


def tokenizer_folder(tmp_path, kind: str):
    """GPT-2's BPE as a tokenizer.json with the family's special tokens and its template."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from torchllm.data.tokenizer import GPT2_PATTERN

    template, specials, bos, eos = TEMPLATES[kind]
    ranks = shared_path("tokenizers", "gpt2", "gpt2.tiktoken")
    TikTokenConverter(vocab_file=str(ranks), pattern=GPT2_PATTERN,
                      extra_special_tokens=specials).converted().save(
        str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": bos, "eos_token": eos, "chat_template": template,
         "tokenizer_class": "PreTrainedTokenizerFast"}))
    return tmp_path


@pytest.mark.parametrize("kind", ["llama3", "qwen3", "qwen3-generation"])
def test_own_template_renders_like_transformers_and_masks_the_assistant_turns(tmp_path, kind):
    from transformers import AutoTokenizer

    folder = tokenizer_folder(tmp_path, kind)
    tok = load_tokenizer(folder)
    template = ChatTemplate(tok)
    assert template.kind == "jinja"
    rendered = template.render(CONV)
    hf = AutoTokenizer.from_pretrained(str(folder))
    expected = hf.apply_chat_template(CONV, tokenize=True, return_dict=False)
    assert rendered.ids == list(expected)
    # The oracle: the targets, decoded, are each assistant content and its end-of-turn token.
    eot = TEMPLATES[kind][3]
    runs, current = [], []
    for i, t in zip(rendered.ids, rendered.trained):
        if t:
            current.append(i)
        elif current:
            runs.append(current)
            current = []
    runs += [current] if current else []
    contents = [m["content"] for m in CONV if m["role"] == "assistant"]
    assert [tok.decode(r) for r in runs] == [c + eot for c in contents]
    assert template.end_of_turn == tok.tok.token_to_id(eot)
    if "generation" in kind:  # transformers' own mask from the markers agrees
        masks = hf.apply_chat_template(CONV, tokenize=True, return_dict=True,
                                       return_assistant_tokens_mask=True)["assistant_masks"]
        assert list(map(bool, masks)) == rendered.trained
    prompt = template.prompt(CONV[:2])
    assert prompt == list(hf.apply_chat_template(CONV[:2], add_generation_prompt=True,
                                                 tokenize=True, return_dict=False))


def test_a_tokenizer_with_a_template_gets_no_added_tokens(tmp_path):
    folder = tokenizer_folder(tmp_path, "qwen3")
    cfg = tiny_config(tmp_path, f"--data.tokenizer={folder}", "--data.chat_tokens=true")
    tok = build_tokenizer(cfg, tmp_path / "data")
    assert not isinstance(tok, ChatTokenizer)
    # Without a template (the same tokenizer.json) the six added tokens are the fallback.
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = build_tokenizer(cfg, tmp_path / "data")
    assert isinstance(tok, ChatTokenizer) and ChatTemplate(tok).kind == "tokens"
