"""A torchllm model as an lm-evaluation-harness model (`lm_eval.api.model.TemplateLM`).

Requests are scored as lm-eval's own `hf` model (lm_eval.models.huggingface.HFLM) scores them
on the HF export of the same checkpoint, so the numbers are comparable with published ones:

- loglikelihood: the context is encoded with BOS, the continuation is what the encoding of
  context + continuation adds after it (TemplateLM._encode_pair: the context's trailing
  whitespace moves to the continuation); an empty context is BOS alone. When the pair is
  longer than `max_length` + 1 the oldest tokens are dropped (HFLM's left truncation); a
  continuation longer than `max_length` is scored in disjoint windows, like a rolling text
  (where HFLM, which assumes continuations fit, fails).
- loglikelihood_rolling: the text (no BOS) in disjoint windows of `max_length` predicted tokens,
  the first conditioned on BOS, each later one on the tokens before it (lm_eval.utils'
  rolling windows with context_len 1), summed. HFLM matches with add_bos_token=False there
  (with the tokenizer's default it also scores a second BOS after the prefix BOS).
- generate_until: the context with BOS, its oldest tokens dropped to leave max_gen_toks of
  room, greedy (or sampled with do_sample) torchllm.eval.generation.generate; a row stops
  once its text holds a stop sequence (`until`) or at EOS, and is cut before the first one.

Batches are sorted by length (longest first) and right-padded; results come back in request
order. Distributed: lm-eval's evaluator splits the documents over `rank`/`world_size` and
gathers the per-document results on rank 0 through `all_gather` / `gather_object` /
`barrier` below (torch.distributed, gloo on CPU); each method here sees its rank's requests.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch
import torch.distributed as dist
from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from torchllm.data.tokenizer import Tokenizer
from torchllm.eval.generation import completion_text, generate
from torchllm.eval.reduce import gather_objects, rank_and_world
from torchllm.loss import whole_logits
from torchllm.models.contract import LanguageModel

DEFAULT_MAX_GEN_TOKS = 256  # HFLM's


class TorchllmLM(TemplateLM):
    def __init__(self, model: LanguageModel, tokenizer: Tokenizer, device: torch.device | str,
                 batch_size: int = 8, max_length: int | None = None,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
                 autocast: Callable[[], ContextManager] = contextlib.nullcontext,
                 group=None, seed: int = 0):
        super().__init__()
        context = model.args.max_seq_len
        if max_length is not None and not 1 < max_length <= context:
            raise ValueError(f"max_length = {max_length}: must be 2..{context} (the model's "
                             "max_seq_len)")
        if batch_size < 1:
            raise ValueError(f"batch_size = {batch_size}: must be >= 1")
        self.model, self.tokenizer = model.eval(), tokenizer
        self._device = torch.device(device)
        self.batch_size, self.max_length = batch_size, max_length or context
        self.max_gen_toks, self.autocast, self.group, self.seed = (
            max_gen_toks, autocast, group, seed)
        self._rank, self._world_size = rank_and_world(group)

    # --- tokens -----------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tokenizer.bos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs):
        """The text's ids, BOS first unless add_special_tokens is False."""
        return self.tokenizer.encode(string, bos=add_special_tokens is not False)

    # --- scoring ----------------------------------------------------------------------------

    @torch.no_grad()
    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(log-likelihood of the continuation, whether it is the greedy one) per pair, in one
        right-padded forward; each input is (context + continuation)[-(max_length + 1):-1]."""
        inputs = []
        for ctx, cont in pairs:
            inputs.append((ctx + cont)[-(self.max_length + 1):][:-1])
        tokens = torch.zeros(len(inputs), max(map(len, inputs)), dtype=torch.long)
        for i, ids in enumerate(inputs):
            tokens[i, : len(ids)] = torch.tensor(ids)
        with self.autocast():
            logits = whole_logits(self.model(tokens.to(self._device)))
        out = []
        for i, ((_, cont), ids) in enumerate(zip(pairs, inputs)):
            # Position t predicts token t + 1: the last len(cont) inputs predict the continuation.
            logp = logits[i, len(ids) - len(cont) : len(ids)].float().log_softmax(dim=-1)
            target = torch.tensor(cont, device=logp.device)
            out.append((logp.gather(-1, target[:, None]).sum().item(),
                        bool((logp.argmax(dim=-1) == target).all())))
        return out

    def _windows(self, ctx: list[int], cont: list[int]) -> list[tuple[list[int], list[int]]]:
        """(context, continuation) pieces that each fit one forward: a continuation longer than
        max_length is scored in disjoint windows of max_length tokens, each conditioned on the
        max_length tokens before it (as loglikelihood_rolling scores a text; HFLM would fail)."""
        if not ctx or not cont:
            raise ValueError(f"a request has {len(ctx)} context and {len(cont)} "
                             "continuation tokens; both must be >= 1")
        full, pieces = ctx + cont, []
        for start in range(len(ctx), len(full), self.max_length):
            end = min(start + self.max_length, len(full))
            pieces.append((full[max(0, end - 1 - self.max_length) : start], full[start:end]))
        return pieces

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        """Scores of (request, context ids, continuation ids): pieces (see _windows) scored in
        batches sorted by length, summed per request (greedy if every piece is)."""
        pieces, owner = [], []
        for i, (_, ctx, cont) in enumerate(requests):
            mine = self._windows(ctx, cont)
            pieces += mine
            owner += [i] * len(mine)
        order = sorted(range(len(pieces)), key=lambda i: -sum(map(len, pieces[i])))
        out: list = [(0.0, True)] * len(requests)
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            for i, (ll, greedy) in zip(batch, self._score([pieces[i] for i in batch])):
                total, all_greedy = out[owner[i]]
                out[owner[i]] = (total + ll, all_greedy and greedy)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, counts = [], []
        for (text,) in [req.args for req in requests]:
            ids = self.tokenizer.encode(text)  # no BOS: the prefix token conditions the first
            mine = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=ids, prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            windows += [(None, ctx, cont) for ctx, cont in mine]
            counts.append(len(mine))
        scores = self._loglikelihood_tokens(windows)
        out, start = [], 0
        for n in counts:
            out.append(sum(ll for ll, _ in scores[start : start + n]))
            start += n
        return out

    # --- generation -------------------------------------------------------------------------

    def _generation_options(self, kwargs: dict) -> tuple[list[str], int, float]:
        """(stop sequences, max new tokens, temperature) of one request's gen_kwargs."""
        kwargs = dict(kwargs)
        until = kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        max_gen = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
        temperature = float(kwargs.pop("temperature", 0.0)) if kwargs.pop("do_sample", False) \
            else 0.0
        return until, min(max_gen, self.max_length - 1), temperature

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        jobs = []
        for i, (context, kwargs) in enumerate(req.args for req in requests):
            until, max_gen, temperature = self._generation_options(kwargs)
            prompt = self.tok_encode(context)[-(self.max_length - max_gen):]  # HFLM's truncation
            jobs.append((i, prompt, until, max_gen, temperature))
        jobs.sort(key=lambda j: (j[3], j[4], -len(j[1])))  # same options together, longest first
        out: list = [None] * len(jobs)
        start = 0
        while start < len(jobs):
            _, _, _, max_gen, temperature = jobs[start]
            batch = [j for j in jobs[start : start + self.batch_size]
                     if (j[3], j[4]) == (max_gen, temperature)]

            def stopped(row: int, ids: list[int], batch=batch) -> bool:
                _, prompt, until, _, _ = batch[row]
                text = completion_text(self.tokenizer, prompt, ids)
                return any(stop and stop in text for stop in until)

            with self.autocast():
                generated = generate(self.model, [j[1] for j in batch], max_gen,
                                     temperature=temperature, seed=self.seed,
                                     eos_id=self.tokenizer.eos_id, device=self._device,
                                     stop_when=stopped)
            for (i, prompt, until, _, _), ids in zip(batch, generated):
                out[i] = cut_at_stop(completion_text(self.tokenizer, prompt, ids), until)
            start += len(batch)
        return out

    # --- distributed: what lm-eval's evaluator calls when world_size > 1 ---------------------

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._world_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self._world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj, dst: int = 0):
        parts = gather_objects(obj, self.group)
        return parts if self._rank == dst else None

    def barrier(self) -> None:
        if self._world_size > 1:
            dist.barrier(group=self.group)


def cut_at_stop(text: str, until: list[str]) -> str:
    """`text` up to the first occurrence of each stop sequence in turn (HFLM's rule)."""
    for stop in until:
        if stop:
            text = text.split(stop)[0]
    return text
