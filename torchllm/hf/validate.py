"""What a Hugging Face folder must be before its weights are converted (and before `hf import`
writes anything): every bad value is one line naming the file, the tensor or key, and what is
allowed (a ValueError; the CLI exits 2).

- `config.json`: no `quantization_config` (FP8 block-scaled, GPTQ, AWQ, bitsandbytes folders
  store other numbers than the weights: casting them is wrong), `vocab_size` a positive
  integer, the float settings numbers and the rope tables objects (a missing key the family
  needs is named too: load.convert_from_hf).
- Each tensor: a float dtype (`FLOAT_DTYPES`; fp8, integer and bool tensors are quantized or not
  weights) whose values are all finite (`torch.isfinite`).
- Shapes: each tensor the model reads has the shape the config implies (a mismatch is refused
  before any padding allocates); the embedding and head have exactly `vocab_size` rows.
- No unknown tensors: every tensor is read by the family's conversion, except the buffers older
  `transformers` saved (`NON_WEIGHTS`: rotary `inv_freq`, GPT-2's causal-mask `attn.bias`).

Padding rule: the seed's rows are `vocab_size` rounded up by `model.vocab_pad_multiple` (or
`vocab_pad_pow2`, or `model.vocab_size` when set), the added rows zero.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
NUMBERS = ("rope_theta", "rms_norm_eps", "layer_norm_epsilon")  # compared as floats
TABLES = ("rope_scaling", "rope_parameters")  # read with .get
NON_WEIGHTS = re.compile(r"(^|\.)(rotary_emb\.inv_freq|attn\.(masked_)?bias)$")


def check_hf_config(config: dict, path: Path) -> int:
    """The folder's vocab_size, once config.json (at `path`) describes plain float weights."""
    quant = config.get("quantization_config")
    if quant is not None:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise ValueError(f"{path} has a quantization_config (quant_method {method!r}): only "
                         "unquantized float weights are read; use the model's unquantized "
                         "(bf16/fp32) release")
    for key in NUMBERS:
        value = config.get(key)
        if value is not None and (type(value) not in (int, float) or not math.isfinite(value)):
            raise ValueError(f"{path}: {key} = {value!r}: must be a finite number")
    for key in TABLES:
        value = config.get(key)
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"{path}: {key} = {value!r}: must be an object (or null)")
    vocab = config.get("vocab_size")
    if type(vocab) is not int or vocab < 1:  # bool is an int subclass: refused too
        raise ValueError(f"{path}: vocab_size = {vocab!r}: must be a positive integer (the "
                         "rows of the embedding)")
    return vocab


def check_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Every tensor of one safetensors file (at `path`) has a float dtype and finite values."""
    allowed = ", ".join(str(d).removeprefix("torch.") for d in FLOAT_DTYPES)
    for name, tensor in tensors.items():
        if tensor.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{path}: tensor {name} is {str(tensor.dtype).removeprefix('torch.')}"
                             f": only float weights are read ({allowed}); a quantized or "
                             "integer checkpoint needs its unquantized release")
        if not torch.isfinite(tensor).all():
            bad = int((~torch.isfinite(tensor)).sum())
            raise ValueError(f"{path}: tensor {name} has {bad} non-finite values (NaN or inf) "
                             f"of {tensor.numel()}: the weights are corrupt; re-download them")


def check_export_dtypes(weights: dict[str, torch.Tensor], step) -> None:
    """Every tensor a checkpoint (at `step`) gives an export has a float dtype: a complex,
    quantized (qint8) or integer one is no weight transformers loads (and a cast to --dtype
    would drop its imaginary part or scale silently)."""
    allowed = ", ".join(str(d).removeprefix("torch.") for d in FLOAT_DTYPES)
    for name, tensor in weights.items():
        if tensor.dtype not in FLOAT_DTYPES:
            raise ValueError(f"checkpoint {step}: tensor {name} is "
                             f"{str(tensor.dtype).removeprefix('torch.')}: an export writes only "
                             f"real float weights ({allowed}); a complex, quantized or integer "
                             "tensor is not a model weight")


def expected_shapes(adapter, args, vocab: int) -> dict[str, tuple[int, ...]]:
    """The Hugging Face tensors (names and shapes) a model with `args` and `vocab` rows maps to
    (the family's to_hf applied to the model's parameters on the meta device)."""
    with torch.device("meta"):
        model = adapter.model_cls(args)
    params = dict(model.named_parameters())  # buffers (expert_bias) have no Hugging Face place
    return {k: tuple(v.shape) for k, v in adapter.to_hf(params, args, vocab).items()}


def check_shapes(weights: dict[str, torch.Tensor], expected: dict, hf_dir: Path,
                 vocab: int) -> None:
    """Each tensor the config implies has its shape (before any conversion or padding)."""
    for name, shape in expected.items():
        tensor = weights.get(name)
        if tensor is None or tuple(tensor.shape) == shape:
            continue
        have = tuple(tensor.shape)
        if have[1:] == shape[1:] and shape[0] == vocab:
            raise ValueError(f"{hf_dir}: {name} has {have[0]} rows but config.json's vocab_size "
                             f"= {vocab}: they must be equal (torchllm pads the rows itself, "
                             "by model.vocab_pad_multiple)")
        raise ValueError(f"{hf_dir}: {name} has shape {list(have)} but config.json implies "
                         f"{list(shape)}: the weights do not match their config")


def check_converted(converted: dict[str, torch.Tensor], adapter, args, hf_dir: Path) -> None:
    """The converted state dict's shapes are the model's (a layout the first check does not
    name, e.g. transformers 5's fused experts)."""
    with torch.device("meta"):
        model = adapter.model_cls(args)
    for name, want in model.state_dict().items():
        got = converted.get(name)
        if got is not None and got.shape != want.shape:
            raise ValueError(f"{hf_dir}: the weights give {name} the shape {list(got.shape)}, "
                             f"the model needs {list(want.shape)}: the weights do not match "
                             "their config")


class ReadTracker(dict):
    """A dict of tensors that records which keys a conversion read (`[]` and `get`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.read: set[str] = set()

    def __getitem__(self, key):
        value = super().__getitem__(key)
        self.read.add(key)
        return value

    def get(self, key, default=None):
        if key in self:
            return self[key]
        return default


def check_all_read(weights: ReadTracker, hf_dir: Path) -> None:
    """Refuse tensors the conversion never read (weights the model has no place for)."""
    unknown = sorted(k for k in weights if k not in weights.read and not NON_WEIGHTS.search(k))
    if unknown:
        more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
        raise ValueError(f"{hf_dir}: tensors the model has no place for: "
                         f"{', '.join(unknown[:3])}{more}; a folder of another architecture "
                         "or with extra weights (e.g. quantization scales) is not imported")


def check_cast(weights: dict[str, torch.Tensor], dtype: str, hf_dir: Path) -> None:
    """The weights cast to --dtype are still finite (float16 tops out at 65504)."""
    for name, tensor in weights.items():
        if not torch.isfinite(tensor).all():
            raise ValueError(f"{hf_dir}: {name} overflows --dtype {dtype} (non-finite once "
                             "cast); choose --dtype bfloat16 or float32")
