"""A tokenizer's own Jinja chat template: conversations render as transformers'
`apply_chat_template` renders them, and the loss mask covers exactly the assistant turns
(their content and end-of-turn token)."""

from __future__ import annotations

import json

import pytest

from torchllm.data import build_tokenizer, load_tokenizer
from torchllm.data.chat.template import ChatTemplate
from torchllm.data.chat.tokens import ChatTokenizer
from torchllm.data.tokenizer import LLAMA3_PATTERN

from conftest import shared_path, tiny_config
from builders.chat import LLAMA3_LIKE, QWEN3_GENERATION, QWEN3_LIKE, TEMPLATES, tokenizer_folder  # noqa: F401

CONV = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4, of course."},
    {"role": "user", "content": "And 3 + 3?"},
    {"role": "assistant", "content": "6.\nDone"},
]

assert QWEN3_GENERATION != QWEN3_LIKE


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
    tok = build_tokenizer(cfg.data, tmp_path / "data")
    assert not isinstance(tok, ChatTokenizer)
    # Without a template (the same tokenizer.json) the six added tokens are the fallback.
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = build_tokenizer(cfg.data, tmp_path / "data")
    assert isinstance(tok, ChatTokenizer) and ChatTemplate(tok).kind == "tokens"


# -- every tokenizer kind against transformers on the exported tokenizer (36 conversations) ----

REPLIES = ["\nHello there.", "4, of course.", "Line one\n\nLine two\n", "naïve café 😀 日本",
           "Tabs\tand, commas; done", "x"]


def conversations() -> list[list[dict]]:
    """36: without / with a system turn, 1-3 user-assistant rounds, the last reply one of
    REPLIES (one starts with a newline, which Llama 3's header "\\n\\n" merges with)."""
    out = []
    for system in (None, "You are terse.\n"):
        for reply in REPLIES:
            for rounds in (1, 2, 3):
                conv = [{"role": "system", "content": system}] if system else []
                for r in range(rounds):
                    conv += [{"role": "user", "content": f"Question {r}?" + "\n" * (r % 2)},
                             {"role": "assistant",
                              "content": reply if r == rounds - 1 else f"Answer {r}."}]
                out.append(conv)
    return out


def marked(kind: str, space: bool) -> str:
    """torchllm's fallback template with {% generation %} around each assistant reply and its
    end of turn: transformers' own assistant mask for it is the loss mask's oracle."""
    sp = "' ' + " if space else ""
    if kind == "llama3":
        head = "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
        turn = "message['content'] + '<|eot_id|>'"
    else:
        head = "'<|' + message['role'] + '_start|>'"
        turn = f"{sp}message['content'] + '<|' + message['role'] + '_end|>'"
    return ("{{ bos_token }}{% for message in messages %}{{ " + head + " }}"
            "{% if message['role'] == 'assistant' %}{% generation %}{{ " + turn + " }}"
            "{% endgeneration %}{% else %}{{ " + turn + " }}{% endif %}{% endfor %}")


CHAT_KINDS = {
    "sentencepiece": lambda tmp: ChatTokenizer(load_tokenizer(
        shared_path("tokenizers", "mistral-sp32k", "tokenizer.model"))),
    "tiktoken-gpt2": lambda tmp: ChatTokenizer(load_tokenizer(
        shared_path("tokenizers", "gpt2", "gpt2.tiktoken"))),
    "tiktoken-llama3": lambda tmp: load_tokenizer(
        shared_path("tokenizers", "llama3", "tokenizer.model")),
    "tokenizer.json": lambda tmp: load_tokenizer(tokenizer_folder(tmp, "qwen3-generation")),
    # Llama 3's split keeps newline runs whole: "assistant\n" + "\nHello" gives one "\n\n"
    "tokenizer.json-llama3-split": lambda tmp: load_tokenizer(tokenizer_folder(
        tmp, "qwen3-generation", LLAMA3_PATTERN)),
    "bytes": lambda tmp: ChatTokenizer(load_tokenizer("bytes")),
}


@pytest.mark.parametrize("kind", [k if k != "tiktoken-llama3" else pytest.param(
    k, marks=pytest.mark.slow) for k in CHAT_KINDS])
def test_every_tokenizer_kind_renders_36_conversations_like_transformers(tmp_path, kind):
    """ids = `apply_chat_template` of the exported tokenizer, loss mask = transformers'
    assistant mask (`{% generation %}` around each reply), conversation by conversation."""
    from transformers import AutoTokenizer

    from torchllm.hf.tokenizer import write_tokenizer

    (tmp_path / "src").mkdir()
    tok = CHAT_KINDS[kind](tmp_path / "src")
    (tmp_path / "hf").mkdir()
    write_tokenizer(tok, tmp_path / "hf", {"max_position_embeddings": 4096}, chat=True)
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    template = ChatTemplate(tok)
    mask_template = None if template.kind == "jinja" else marked(
        template.kind, space=kind == "sentencepiece")
    convs = conversations()
    assert len(convs) == 36
    for conv in convs:
        rendered = template.render(conv)
        ids = list(hf.apply_chat_template(conv, tokenize=True, return_dict=False))
        assert rendered.ids == ids, conv
        mask = hf.apply_chat_template(conv, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True,
                                      chat_template=mask_template)
        assert list(mask["input_ids"]) == ids, conv  # the marked template renders the same
        assert rendered.trained == list(map(bool, mask["assistant_masks"])), conv
