"""Token ids of a (context, continuation) pair as the model sees the text: the whole string at once.

Encoding the two parts apart is not the same: a SentencePiece tokenizer adds its dummy-prefix
piece to the continuation too (' Paris' alone is ['▁', '▁P', 'aris'], after 'Answer:' it is
['▁P', 'aris']), and any tokenizer may merge characters across the boundary. So the whole
string is encoded once and split where the context's own encoding stops agreeing with it, as
lm-evaluation-harness and nanochat's CORE do; a context's trailing whitespace first moves into
the continuation (lm-eval's rule), since most tokenizers attach a space to the word after it.
"""

from __future__ import annotations

from torchllm.data.tokenizer import Tokenizer


def split_whitespace(context: str, continuation: str) -> tuple[str, str]:
    """(context, continuation) with the context's trailing whitespace moved to the continuation."""
    kept = context.rstrip()
    return kept, context[len(kept):] + continuation


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def encode_continuation(tokenizer: Tokenizer, context: str, continuation: str,
                        max_len: int | None = None) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) whose concatenation is encode(context + continuation).

    The context starts with BOS. The context's tokens are the longest common prefix of the whole
    string's encoding and the context's own (at least one token is left to the continuation).
    With `max_len`, the continuation keeps its first max_len - 1 tokens and the context loses
    its oldest tokens until the pair fits.
    """
    context, continuation = split_whitespace(context, continuation)
    whole = tokenizer.encode(context + continuation, bos=True)
    cut = min(common_prefix_len(whole, tokenizer.encode(context, bos=True)), len(whole) - 1)
    ctx_ids, cont_ids = whole[:cut], whole[cut:]
    if max_len is not None:
        cont_ids = cont_ids[: max_len - 1]
        ctx_ids = ctx_ids[-(max_len - len(cont_ids)):]
    return ctx_ids, cont_ids
