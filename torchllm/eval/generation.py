"""Autoregressive sampling with a KV cache: temperature, top-k, top-p, seed, EOS stop, batches.

Prompts of different lengths share one batch without padding, as in Meta's reference Llama
generator: every row starts at position 0, the model runs from the shortest prompt's end, and
while a row is still inside its own prompt its next token is the prompt's, not a sample. So a
row's output does not depend on the other rows of its batch.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch

from torchllm.data.tokenizer import Tokenizer, readable
from torchllm.loss import whole_logits
from torchllm.models import spec_of
from torchllm.models.contract import LanguageModel


def completion_text(tokenizer: Tokenizer, prompt: list[int], ids: list[int]) -> str:
    """The text `ids` add after `prompt`, as the tokenizer decodes the whole sequence.

    Decoding the completion alone can lose the space at the boundary (a SentencePiece decoder
    drops a leading '▁' of the first piece: 'is' + 'a number'), so prompt + completion is
    decoded together (cut at the first EOS, no special tokens) and cut at the prompt's length.
    """
    return readable(tokenizer, list(prompt) + list(ids))[len(readable(tokenizer, prompt)):]


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Set to -inf every logit outside the top-k and outside the top-p nucleus.

    The nucleus is the smallest set of most likely tokens whose probabilities sum to >= top_p
    (the most likely token is always kept). top_k = 0 and top_p = 1 disable each filter.
    """
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p.
        drop_sorted = probs.cumsum(dim=-1) - probs >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(
    logits: torch.Tensor,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Next token ids [batch] from last-position logits [batch, vocab]; temperature 0 = argmax."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = filter_logits(logits.float() / temperature, top_k, top_p)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: LanguageModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_id: int | None = None,
    use_cache: bool = True,
    stop_early: bool = True,
    device: torch.device | None = None,
    stop_when: Callable[[int, list[int]], bool] | None = None,
) -> list[list[int]]:
    """The generated ids of each prompt (prompt excluded), cut after EOS when eos_id is given.

    Each row gets up to `max_new_tokens`, fewer when prompt + generation would exceed the
    model's max_seq_len. Without the cache every step reruns the whole sequence (the reference
    the cache is tested against). `stop_early = False` runs every step even after all rows hit
    EOS, so all ranks of a sharded model run the same number of forward passes. `device` is
    where the tokens live and the model computes (default: its first parameter's device; pass
    the training device when FSDP offloads the parameters to CPU). `stop_when(row, ids)`, asked
    after each new token of a row still generating (ids: that row's generated ids so far), ends
    that row when it returns True (e.g. a stop sequence appeared in its text).
    """
    if temperature < 0 or top_k < 0 or not 0 < top_p <= 1 or max_new_tokens < 0:
        raise ValueError(f"temperature = {temperature}, top_k = {top_k}, top_p = {top_p}, "
                         f"max_new_tokens = {max_new_tokens}: need temperature >= 0, top_k >= 0, "
                         "0 < top_p <= 1, max_new_tokens >= 0")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (encode with bos=True)")
    max_seq_len = model.args.max_seq_len
    lengths = [len(p) for p in prompts]
    if max(lengths) >= max_seq_len:
        raise ValueError(f"a prompt has {max(lengths)} tokens; the model's max_seq_len is "
                         f"{max_seq_len}, which leaves no room to generate")
    device = next(model.parameters()).device if device is None else torch.device(device)
    total = min(max_seq_len, max(lengths) + max_new_tokens)
    tokens = torch.zeros(len(prompts), total, dtype=torch.long, device=device)
    in_prompt = torch.zeros_like(tokens, dtype=torch.bool)
    for row, p in enumerate(prompts):
        tokens[row, : len(p)] = torch.tensor(p, device=device)
        in_prompt[row, : len(p)] = True
    limit = torch.tensor([min(total, n + max_new_tokens) for n in lengths], device=device)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    cache = spec_of(model).cache_cls(total) if use_cache else None  # the family's cache

    was_training = model.training
    model.eval()
    # Eagerly, even when the training blocks are compiled (fullgraph): the KV cache is keyed
    # by module and grows every step, so compiled blocks would recompile per layer and per
    # length until torch.compile's recompile limit fails the run.
    try:
        with torch.compiler.set_stance("force_eager"):
            prev = 0
            for cur in range(min(lengths), total):
                if cache is not None:
                    logits = whole_logits(model(tokens[:, prev:cur], cache))
                else:
                    logits = whole_logits(model(tokens[:, :cur]))
                nxt = sample_next(logits[:, -1], temperature, top_k, top_p, generator)
                nxt = torch.where(in_prompt[:, cur], tokens[:, cur], nxt)
                generating = ~in_prompt[:, cur] & ~done & (cur < limit)
                tokens[:, cur] = torch.where(generating | in_prompt[:, cur], nxt, tokens[:, cur])
                if eos_id is not None:
                    done |= generating & (nxt == eos_id)
                if stop_when is not None:
                    for row in generating.nonzero().flatten().tolist():
                        if stop_when(row, tokens[row, lengths[row] : cur + 1].tolist()):
                            limit[row] = cur + 1  # its output ends here
                done |= cur + 1 >= limit
                prev = cur
                if stop_early and bool(done.all()):
                    break
    finally:
        model.train(was_training)

    out = []
    for row, n in enumerate(lengths):
        ids = tokens[row, n : int(limit[row])].tolist()
        if eos_id is not None and eos_id in ids:
            ids = ids[: ids.index(eos_id) + 1]
        out.append(ids)
    return out


@torch.no_grad()
def generate_stream(
    model: LanguageModel,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_id: int | None = None,
) -> Iterator[int]:
    """One prompt's generated ids, yielded as each is sampled (EOS included, then stop).

    The same tokens as `generate(model, [prompt], ...)` with the same arguments: the same
    forward passes with a KV cache and the same generator draws, one token at a time.
    """
    if temperature < 0 or top_k < 0 or not 0 < top_p <= 1 or max_new_tokens < 0:
        raise ValueError(f"temperature = {temperature}, top_k = {top_k}, top_p = {top_p}, "
                         f"max_new_tokens = {max_new_tokens}: need temperature >= 0, top_k >= 0, "
                         "0 < top_p <= 1, max_new_tokens >= 0")
    max_seq_len = model.args.max_seq_len
    if not prompt or len(prompt) >= max_seq_len:
        raise ValueError(f"the prompt has {len(prompt)} tokens; it needs at least 1 and fewer "
                         f"than the model's max_seq_len ({max_seq_len})")
    device = next(model.parameters()).device
    total = min(max_seq_len, len(prompt) + max_new_tokens)
    generator = torch.Generator(device=device).manual_seed(seed)
    cache = spec_of(model).cache_cls(total)
    was_training = model.training
    model.eval()
    try:
        step_input = torch.tensor([prompt], device=device)
        for _ in range(len(prompt), total):
            logits = whole_logits(model(step_input, cache))
            nxt = sample_next(logits[:, -1], temperature, top_k, top_p, generator)
            token = int(nxt[0])
            yield token
            if token == eos_id:
                return
            step_input = nxt[:, None]
    finally:
        model.train(was_training)
