"""A tokenizer's chat template renders under a time and a size limit: a template that loops for
hours or builds gigabytes stops with one line naming its tokenizer_config.json (issue 52,
item 11)."""

from __future__ import annotations

import json
import threading
import time

import pytest

from torchllm.config import ConfigError
from torchllm.data import load_tokenizer
from torchllm.data.chat import limits
from torchllm.data.chat.template import ChatTemplate

CONV = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
GOOD = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + ' ' + m['content'] + "
        "'<|im_end|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant ' }}"
        "{% endif %}")


def folder_with_template(tmp_path, template: str):
    """A WordLevel tokenizer.json (`tokenizers`) and a tokenizer_config.json with `template`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "user", "assistant", "Hi", "Hello",
             "x"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)},
                                     unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(words[:3])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "chat_template": template}))
    return tmp_path


def stopped(tmp_path, template: str, *must_name: str) -> str:
    folder = folder_with_template(tmp_path, template)
    with pytest.raises(ConfigError) as e:
        ChatTemplate(load_tokenizer(str(folder / "tokenizer.json"))).render(CONV)
    message = str(e.value)
    assert "\n" not in message
    assert str(folder / "tokenizer_config.json") in message, message
    for name in must_name:
        assert name in message, message
    return message


def test_a_template_that_never_finishes_is_stopped_by_the_time_limit(tmp_path, monkeypatch):
    """Nested range(100000) loops (10^10 iterations), rendered in a thread of its own as a data
    loader's would be: stopped after the limit with one line; later renders are unaffected."""
    monkeypatch.setattr(limits, "RENDER_SECONDS", 1.0)
    loops = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
             + GOOD)
    outcome = []

    def attempt():
        try:
            stopped(tmp_path, loops, "longer than 1 s")
            outcome.append("stopped")
        except BaseException as e:  # noqa: BLE001 - reported by the assert below
            outcome.append(repr(e))

    worker = threading.Thread(target=attempt, daemon=True)  # (a hang must not hold pytest)
    worker.start()
    worker.join(30)
    assert outcome == ["stopped"], outcome or "still rendering after 30 s"
    # Nothing is left behind: the next renders (this thread, another one) are unaffected.
    good = ChatTemplate(load_tokenizer(str(folder_with_template(tmp_path, GOOD) /
                                           "tokenizer.json")))
    time.sleep(1.5)
    results = []
    worker = threading.Thread(target=lambda: results.append(good.render(CONV).ids))
    worker.start()
    worker.join()
    assert results == [good.render(CONV).ids] and results[0]


def test_a_template_with_large_output_is_stopped_by_the_size_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(limits, "RENDER_CHARS", 10_000)
    stopped(tmp_path, "{% for i in range(20000) %}xx{% endfor %}" + GOOD, "10,000 characters")


@pytest.mark.parametrize("expression,named", [("('x' * 100000) | length", "100,000 items"),
                                               ("([1] * 100000) | length", "100,000 items"),
                                               ("7 ** 1000", "'**'")],
                         ids=["str", "list", "pow"])
def test_one_operator_building_a_huge_value_is_refused(tmp_path, monkeypatch, expression,
                                                       named):
    """`'x' * n` or `n ** m` past the caps (a gigabyte or a giant integer built in one C call,
    which no time limit can interrupt) is refused before it is built; here with small caps (the
    rendered text stays short: the output limit is not what stops them)."""
    monkeypatch.setattr(limits, "RENDER_CHARS", 10_000)
    monkeypatch.setattr(limits, "POW_BITS", 64)
    stopped(tmp_path, "{{ " + expression + " }}" + GOOD, named)


def test_the_default_limits_are_finite():
    assert 0 < limits.RENDER_SECONDS <= 60 and 0 < limits.RENDER_CHARS <= 1 << 30
