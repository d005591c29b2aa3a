"""LoRA (Hu et al., 2021): freeze the base model, train a low-rank update beside chosen linears.

A targeted `nn.Linear` becomes a `LoRALinear`: the same module (its `weight` and `bias` keep
their names, so base checkpoints load into it), frozen, plus two small trainable layers
`lora_A` (rank x in) and `lora_B` (out x rank):

    y = x W^T + b + (alpha / rank) * B(A(dropout(x)))

Initialised as PEFT does (A: Kaiming-uniform with a = sqrt(5), B: zeros), so step 0 computes
exactly the base model. `apply_lora` runs on the meta-device model before it is parallelized
(parallel/build.py): FSDP2, DDP, activation checkpointing and compile then wrap the LoRA model
like any other, and the optimizer only sees the parameters that still require gradients.
Every family declares which of its linears may be targeted (`ModelSpec.lora_targets`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from torchllm.config.job_config import ConfigError
from torchllm.config.loader import flat_toml
from torchllm.models.contract import LanguageModel

ADAPTER_PARTS = ("lora_A", "lora_B")
TOKEN_DELTA = "token_delta"  # the trainable rows of added tokens (add_token_rows)


class LoRALinear(nn.Linear):
    """nn.Linear with a frozen weight (and bias) and a trainable low-rank update."""

    def __init__(self, in_features: int, out_features: int, bias: bool, rank: int,
                 alpha: float, dropout: float = 0.0, device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.lora_A = nn.Linear(in_features, rank, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(rank, out_features, bias=False, device=device, dtype=dtype)

    @classmethod
    def wrap(cls, linear: nn.Linear, rank: int, alpha: float, dropout: float) -> "LoRALinear":
        """A LoRALinear holding `linear`'s own weight and bias Parameters (frozen)."""
        new = cls(linear.in_features, linear.out_features, linear.bias is not None, rank, alpha,
                  dropout, device=linear.weight.device, dtype=linear.weight.dtype)
        new.weight = linear.weight
        new.bias = linear.bias
        for p in (new.weight, new.bias):
            if p is not None:
                p.requires_grad_(False)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(x, self.weight, self.bias)
        return base + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    @torch.no_grad()
    def reset_lora_parameters(self) -> None:
        """PEFT's init: A Kaiming-uniform (a = sqrt(5), as nn.Linear), B zero: B @ A = 0."""
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def delta_weight(self) -> torch.Tensor:
        return (self.lora_B.weight @ self.lora_A.weight) * self.scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha:g}"


def family_targets(family: str) -> tuple[str, ...]:
    """The linear layers (names inside a block) the family `family` (model.name) lets LoRA
    target."""
    from torchllm import models

    return models.get(family).lora_targets


def resolve_targets(lcfg, family: str) -> list[str]:
    """lora.target_modules (of the [lora] section `lcfg`) checked against the family's names
    ([] = all of them)."""
    allowed = family_targets(family)
    asked = list(lcfg.target_modules) or list(allowed)
    unknown = [name for name in asked if name not in allowed]
    if unknown or not asked:
        raise ConfigError(
            f"lora.target_modules = {list(lcfg.target_modules)}: "
            + (f"{family} has no linear layer {unknown[0]!r}" if unknown
               else f"{family} declares no LoRA targets")
            + f"; allowed: {', '.join(allowed) or 'none'} ([] = all)", "lora.target_modules")
    return asked


def check_lora(lcfg, family: str, float8: bool, dims=None) -> None:
    """Every LoRA check that needs no model: the [lora] section `lcfg`'s values, its target
    names in the family `family` (model.name), what it cannot combine with (`float8`:
    float8.enable). `dims`: the run's ParallelDims (None: not known yet)."""
    if not lcfg.enable:
        return
    if lcfg.rank < 1:
        raise ConfigError(f"lora.rank = {lcfg.rank}: must be a positive integer", "lora.rank")
    resolve_targets(lcfg, family)
    refused = [("float8.enable", float8, "float8 swaps the linears LoRA wraps")]
    if dims is not None:
        refused += [
            ("parallelism.tensor_parallel_degree", dims.tp_enabled,
             "TP would shard the adapters like their base weights"),
            ("parallelism.pipeline_parallel_degree", dims.pp_enabled,
             "pipeline stages are built without adapters"),
        ]
    for key, on, why in refused:
        if on:
            raise ConfigError(f"lora.enable with {key} is not supported ({why}); turn one of "
                              "them off (LoRA runs with FSDP2, DDP, bf16, compile and AC)", key)


def added_tokens(tokenizer) -> tuple[int, int] | None:
    """(first id, count) of the tokens the run's tokenizer adds after its base vocabulary (a
    ChatTokenizer's chat tokens), or None when it adds none."""
    added, base = getattr(tokenizer, "added", None), getattr(tokenizer, "base", None)
    if not added or base is None:
        return None
    return int(base.vocab_size), len(added)


def add_token_rows(module: nn.Module, start: int, count: int) -> None:
    """PEFT's trainable_token_indices on one table (nn.Embedding or the output nn.Linear): rows
    start..start+count train through `token_delta` (count x dim, zero at the start, added to
    those rows: the same function and gradients as PEFT's replaced rows), the table itself
    stays frozen. The model's Embedding and lm_head read it (`rows_added`)."""
    weight = module.weight
    module.register_parameter(TOKEN_DELTA, nn.Parameter(
        torch.zeros(count, weight.shape[1], device=weight.device, dtype=weight.dtype)))
    module.token_start = start


def rows_added(weight: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """`weight` (module's table, or its per-step cast) with module's trainable token rows
    added (unchanged without them)."""
    delta = getattr(module, TOKEN_DELTA, None)
    if delta is None:
        return weight
    start, end = module.token_start, module.token_start + delta.shape[0]
    return torch.cat([weight[:start], weight[start:end] + delta.to(weight.dtype), weight[end:]])


def token_ids(sd: dict, key: str, vocab: int) -> list[int]:
    """The ids a checkpoint's `key` (`tok_embeddings.token_delta`, ...) trains: the last of the
    tokenizer's `vocab` ids (the added tokens come after the base vocabulary)."""
    return list(range(vocab - sd[key].shape[0], vocab))


def apply_lora(model: LanguageModel, lcfg, mcfg, float8: bool,
               new_tokens: tuple[int, int] | None = None) -> list[str]:
    """Wrap the targeted linears (in place), freeze every other parameter (but the embeddings
    and head with lora.train_embeddings, and the rows of `new_tokens`, (first id, count), with
    lora.train_new_tokens); returns the wrapped modules' names. `lcfg`, `mcfg`: the [lora] and
    [model] sections, `float8`: float8.enable (check_lora). No-op when lora.enable is false."""
    if not lcfg.enable:
        return []
    check_lora(lcfg, mcfg.name, float8)
    targets = set(resolve_targets(lcfg, mcfg.name))
    for p in model.parameters():
        p.requires_grad_(False)
    wrapped = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in targets and type(child) is nn.Linear:
                setattr(module, child_name, LoRALinear.wrap(child, lcfg.rank, lcfg.alpha,
                                                            lcfg.dropout))
                wrapped.append(f"{name}.{child_name}" if name else child_name)
    found = {w.rsplit(".", 1)[-1] for w in wrapped}
    missing = [t for t in resolve_targets(lcfg, mcfg.name) if t not in found]
    if missing:
        raise ConfigError(f"lora.target_modules: {missing[0]!r} matches no linear layer of "
                          f"{mcfg.name}/{mcfg.flavor}; remove it",
                          "lora.target_modules")
    if lcfg.train_embeddings:
        for module in embedding_modules(model):
            module.weight.requires_grad_(True)
    elif lcfg.train_new_tokens and new_tokens:
        for module in token_tables(model):
            add_token_rows(module, *new_tokens)
    return wrapped


def embedding_modules(model: LanguageModel) -> list[nn.Module]:
    """The embedding tables and the output head (lora.train_embeddings trains these)."""
    found = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    return found + ([model.output] if model.output is not None else [])


def token_tables(model: LanguageModel) -> list[nn.Module]:
    """The token embedding and the output head (None when tied) a token's rows live in."""
    return [m for m in (model.tok_embeddings, model.output)
            if m is not None]


def build_with_lora(spec, model_args, lcfg, mcfg, float8: bool,
                    new_tokens: tuple[int, int] | None = None) -> LanguageModel:
    """spec.build(model_args), with LoRA applied when lora.enable (call under a device; `lcfg`,
    `mcfg`, `float8`: as apply_lora's); `new_tokens`: added_tokens(the run's tokenizer)."""
    model = spec.build(model_args)
    apply_lora(model, lcfg, mcfg, float8, new_tokens)
    return model


def reset_adapters(model: nn.Module) -> None:
    """Initialise every adapter (after the base init, drawing from the same generator)."""
    for module in model.modules():
        if isinstance(module, LoRALinear):
            module.reset_lora_parameters()
        delta = getattr(module, TOKEN_DELTA, None)
        if delta is not None:  # the rows start as the (loaded) table's
            with torch.no_grad():
                delta.zero_()


def init_weights(model: LanguageModel, buffer_device: torch.device | None = None) -> None:
    """model.init_weights, then the adapters' init (the base draws the same numbers as
    without LoRA, so a fresh LoRA model starts from the same base as a plain one)."""
    model.init_weights(buffer_device=buffer_device)
    reset_adapters(model)


def is_adapter_key(key: str) -> bool:
    """Whether a state-dict key (model or optimizer) names an adapter tensor."""
    return any(f".{part}." in f".{key}." for part in (*ADAPTER_PARTS, TOKEN_DELTA))


def adapter_modules(sd_keys) -> list[str]:
    """Names of the LoRA-wrapped modules in a state dict's keys (from their lora_A keys)."""
    return sorted({k[: -len(".lora_A.weight")] for k in sd_keys if k.endswith(".lora_A.weight")})


def merge_weights(sd: dict[str, torch.Tensor], scaling: float, vocab: int | None = None
                  ) -> dict[str, torch.Tensor]:
    """A LoRA model's state dict as the plain model's: W + scaling * B @ A, adapters dropped
    (computed in float32, returned in W's dtype); trainable token rows added to their table's
    rows (the last of the tokenizer's `vocab` ids)."""
    out = {k: v for k, v in sd.items() if not is_adapter_key(k)}
    for key in [k for k in sd if k.endswith(f".{TOKEN_DELTA}")]:
        if vocab is None:
            raise ValueError(f"{key}: merging trainable token rows needs the tokenizer's vocab")
        table = key.removesuffix(TOKEN_DELTA) + "weight"
        ids = token_ids(sd, key, vocab)
        w = out[table].clone()
        w[ids[0]: ids[-1] + 1] += sd[key].to(w.dtype)
        out[table] = w
    for name in adapter_modules(sd):
        w = out[f"{name}.weight"]
        a, b = sd[f"{name}.lora_A.weight"].float(), sd[f"{name}.lora_B.weight"].float()
        out[f"{name}.weight"] = (w.float() + scaling * (b @ a)).to(w.dtype)
    return out


def parameter_summary(model: nn.Module, lcfg, family: str) -> str:
    """'; LoRA r=8 alpha=16 on wq, wk: 12,345 of 1,234,567 params train (1.00%)' or '' (`lcfg`:
    the [lora] section, `family`: model.name)."""
    if not lcfg.enable:
        return ""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    embeddings = " + embeddings" if lcfg.train_embeddings else ""
    rows = [getattr(m, TOKEN_DELTA).shape[0] for m in token_tables(model)
            if getattr(m, TOKEN_DELTA, None) is not None]
    if rows:
        embeddings = f" + the {rows[0]} added tokens' rows of {len(rows)} table(s)"
    targets = ", ".join(resolve_targets(lcfg, family))
    return (f"; LoRA r={lcfg.rank} alpha={lcfg.alpha:g} on {targets}"
            f"{embeddings}: {trainable:,} of {total:,} params train "
            f"({100 * trainable / max(total, 1):.2f}%)")


def resume_mismatch(saved_toml: str, current_toml: str, resume: bool = True,
                    path=None) -> str | None:
    """Which [lora] key differs between the config a checkpoint was saved under and this run's,
    as one line naming it (None: the adapters have the same shape and places). The advice is
    another command than the one that failed: a resume is told to start a new run from the
    checkpoint (checkpoint.initial_load_path); a new run already doing that (`resume` False)
    is told to start from the checkpoint's merged weights (an hf export of checkpoint `path`)."""
    old, new = _lora_keys(flat_toml(saved_toml)), _lora_keys(flat_toml(current_toml))
    if not old["lora.enable"] and not new["lora.enable"]:
        return None
    if not resume and not old["lora.enable"]:  # LoRA on a base checkpoint: fresh adapters,
        return None                             # so the misfit is elsewhere (shapes, names)
    for key in old:
        if old[key] != new[key]:
            if resume:
                advice = (f"set {key} = {old[key]!r} to resume, or start a new run from it "
                          "(checkpoint.initial_load_path)")
            else:
                advice = (f"set {key} = {old[key]!r} to go on training its adapters, or start "
                          "from its merged weights: python -m torchllm.hf export --checkpoint "
                          f"{path or 'CHECKPOINT'} --out DIR, then checkpoint.initial_load_path "
                          "= DIR with checkpoint.initial_load_in_hf = true")
            return (f"the checkpoint was saved with {key} = {old[key]!r}, this run has "
                    f"{new[key]!r}: its adapters cannot load; {advice}")
    return None


def _lora_keys(flat: dict) -> dict:
    """The [lora] keys that shape the adapters, defaults filled in, [] targets resolved."""
    from torchllm import models
    from torchllm.config.sections import Lora

    default = Lora()
    out = {f"lora.{k}": flat.get(f"lora.{k}", getattr(default, k))
           for k in ("enable", "rank", "target_modules", "train_embeddings", "train_new_tokens")}
    if out["lora.enable"] and not out["lora.target_modules"]:
        name = flat.get("model.name", "llama3")
        out["lora.target_modules"] = list(models.get(name).lora_targets)
    return out


def fresh_adapters(sds: dict, metadata, resume: bool) -> dict:
    """A LoRA run starting from a base checkpoint (checkpoint.initial_load_path, not a resume):
    the adapter tensors the checkpoint lacks are taken out of the model's state dict to load
    (they keep their fresh init) and returned, to be put back before it is applied."""
    if resume or "model" not in sds:
        return {}
    saved = metadata.state_dict_metadata
    fresh = {k: v for k, v in sds["model"].items()
             if is_adapter_key(k) and f"model.{k}" not in saved}
    for key in fresh:
        del sds["model"][key]
    return fresh


def checkpoint_misfit(saved_toml: str | None, current_toml: str | None,
                      where: str, resume: bool = True) -> tuple[str, str] | None:
    """(message, key) when checkpoint `where`, which does not fit this model, was saved under
    other [lora] settings (`saved_toml`: its step folder's config.toml), else None. `resume`:
    this run's own checkpoint (else a new run's initial load)."""
    if not current_toml or not saved_toml:
        return None
    message = resume_mismatch(saved_toml, current_toml, resume, where)
    if message is None:
        return None
    return f"checkpoint {where}: {message}", message.split(" = ")[0].rsplit(" ", 1)[-1]


def lora_fit(fit) -> None:
    """The resume's fit check for LoRA (torchllm/checkpoint/resume/fit.py): a base checkpoint's
    missing adapters keep their fresh init (put back at apply), and a step saved under other
    [lora] settings leaves the message a shape refusal names instead of its own."""
    fresh = fresh_adapters(fit.states, fit.step.metadata, fit.resume)  # LoRA on a base step
    if fresh:
        fit.on_apply.append(lambda states: states["model"].update(fresh))
    misfit = checkpoint_misfit(fit.step.config_text, fit.run_info.get("config_toml"), fit.where,
                               fit.resume)
    if misfit:
        fit.hints.append(misfit)


def plain_weights(weights: dict[str, torch.Tensor], lcfg, merge: bool = True,
                  vocab: int | None = None) -> dict:
    """A checkpoint's weights as the plain model's (`lcfg`: its run's [lora] section): with
    LoRA, merged (W + alpha/rank * B @ A, trainable token rows added) or the base alone
    (merge=False); unchanged without LoRA."""
    if not lcfg.enable:
        return weights
    if merge:
        return merge_weights(weights, lcfg.alpha / lcfg.rank, vocab)
    return {k: v for k, v in weights.items() if not is_adapter_key(k)}
