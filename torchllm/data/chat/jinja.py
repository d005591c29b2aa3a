"""A tokenizer's own Jinja chat template (`tokenizer_config.json`'s `chat_template`, as in
Llama 3 Instruct or Qwen3), rendered as transformers' `apply_chat_template` renders it, with the
loss mask on exactly the assistant turns.

The mask comes from rendering prefixes: the text an assistant message adds is what
`messages[:i + 1]` renders past `messages[:i]` with the generation prompt (the assistant's
header). Of that text, the tokens up to and including the last special token (the end of turn,
e.g. <|eot_id|>, <|im_end|>) are targets; what a template writes after it (a newline) is not,
nor is anything the model is not asked to produce. The whole conversation is tokenized once and
each token is a target when it holds a character of an assistant span (a token merging the
header's last characters with the content's first is the content's, as transformers'
`return_assistant_tokens_mask` counts it), so the ids are exactly those of
`apply_chat_template(messages, tokenize=True)`.

Also: `fallback_template()`, the Jinja text of torchllm's own rendering for tokenizers without a
template (the 6 added chat tokens, or Llama 3's header tokens), which the Hugging Face export
writes so that `apply_chat_template` reproduces what the run trained on.
"""

from __future__ import annotations

from datetime import datetime

from torchllm.config.job_config import ConfigError
from torchllm.data.chat import limits
from torchllm.data.chat.limits import RenderLimit, limited
from torchllm.data.chat.sizes import refuse_over


def template_of(config: dict) -> str | None:
    """The chat template of a tokenizer_config.json (a string, or the "default" of a list)."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template
                 if isinstance(t, dict) and isinstance(t.get("name"), str)}
        template = named.get("default")
    return template if isinstance(template, str) and template.strip() else None


class TemplateLimitError(ConfigError):
    """A render stopped by a limit (time, size): the template, not one conversation, is bad."""


def _compile(source: str, origin: str = "the tokenizer's chat_template"):
    """Compile like transformers: a sandbox, trim_blocks / lstrip_blocks, raise_exception;
    every operation that can build a large value capped (chat/bounded.py, chat/limits.py)."""
    try:
        from jinja2.exceptions import TemplateError
    except ImportError:
        raise ConfigError("the tokenizer has a Jinja chat template: `pip install jinja2` to "
                          "render it", "data.tokenizer") from None
    from torchllm.data.chat.bounded import BoundedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def strftime_now(fmt):
        refuse_over("strftime_now", 16 * len(str(fmt)))  # %c: 24 characters for 2
        return datetime.now().strftime(fmt)

    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True,
                             extensions=[_generation_extension()])
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise ConfigError(f"the chat template of {origin} is not valid Jinja: {e}",
                          "data.tokenizer") from None


def _generation_extension():
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask markers) render
    their body unchanged: the mask here comes from prefixes, which every template supports."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    return Generation


class JinjaChat:
    """Render conversations with a tokenizer.json tokenizer's own chat template."""

    def __init__(self, tokenizer, source: str, special: dict[str, str]):
        self.tokenizer, self.source = tokenizer, source
        # Where the template comes from (its tokenizer_config.json), for the errors.
        self.origin = str(getattr(tokenizer, "chat_template_file", None)
                          or "the tokenizer's chat_template")
        self.template = _compile(source, self.origin)
        self.special = special  # bos_token, eos_token, ... as the template expects them
        self.end_of_turn = self._end_of_turn()

    def text(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        from jinja2.exceptions import TemplateError

        try:
            return limited(lambda: self.template.generate(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.special))
        except TemplateError as e:
            raise ValueError(f"the chat template refused the conversation: {e}") from None
        except (RenderLimit, RecursionError, MemoryError, OverflowError) as e:
            why = e if isinstance(e, (RenderLimit, OverflowError)) else type(e).__name__
            raise TemplateLimitError(
                f"the chat template of {self.origin} was stopped ({why}): a template must "
                f"render a conversation within {limits.RENDER_SECONDS:g} s and "
                f"{limits.RENDER_CHARS:,} characters; use a trusted tokenizer_config.json",
                "data.tokenizer") from None

    def render(self, messages: list[dict]) -> tuple[list[int], list[bool]]:
        """(ids, whether each id is a target) of a whole conversation."""
        full = self.text(messages)
        spans = []
        for i, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            before = self.text(messages[:i], add_generation_prompt=True)
            upto = self.text(messages[: i + 1])
            if not (upto.startswith(before) and full.startswith(upto)):
                raise ValueError(f"message {i}: the chat template does not render this "
                                 "conversation prefix by prefix, so its assistant turns cannot "
                                 "be told apart for the loss mask")
            spans.append((len(before), len(upto)))
        encoding = self.tokenizer.tok.encode(full, add_special_tokens=False)
        ids, offsets = encoding.ids, encoding.offsets
        special = self.tokenizer.special_ids
        trained = [False] * len(ids)
        for start, end in spans:
            inside = [k for k, (s, e) in enumerate(offsets) if s < end and e > start]
            last = max((k for k in inside if ids[k] in special), default=None)
            for k in inside:
                trained[k] = last is None or k <= last
        return ids, trained

    def prompt(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.tok.encode(self.text(messages, add_generation_prompt=True),
                                         add_special_tokens=False).ids

    def _end_of_turn(self) -> int:
        """The last special token an assistant turn renders (generation stops there)."""
        probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
        try:
            ids, trained = self.render(probe)
        except TemplateLimitError:
            raise
        except ValueError:
            return self.tokenizer.eos_id
        ends = [i for i, t in zip(ids, trained) if t and i in self.tokenizer.special_ids]
        return ends[-1] if ends else self.tokenizer.eos_id


TOKENS_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '_start|>' + message['content'] + '<|' + message['role']"
    " + '_end|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant_start|>' }}"
    "{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content']"
    " + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


def fallback_template(kind: str) -> str:
    """The Jinja text of torchllm's own rendering ("tokens" or "llama3", see chat.py)."""
    return {"tokens": TOKENS_TEMPLATE, "llama3": LLAMA3_TEMPLATE}[kind]
