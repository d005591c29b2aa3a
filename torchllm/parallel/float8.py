"""Float8 training (torchao): swap nn.Linear layers for Float8Linear.

Float8 matmuls need tensor cores of SM89+ (Ada, Hopper, Blackwell). Elsewhere the conversion is
refused unless `float8.emulate` is set, which runs the same casts and scales with
high-precision matmuls: a correctness test, not a speed-up.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from torchllm.config.job_config import ConfigError
from torchllm.log import logger


def float8_supported(device_type: str) -> bool:
    return (device_type == "cuda" and torch.cuda.is_available()
            and torch.cuda.get_device_capability() >= (8, 9))


def float8_module_filter(filter_fqns: list[str]):
    """Convert a Linear unless its name matches filter_fqns or a dim is not a multiple of 16.

    float8 matmul kernels need both dims to be multiples of 16; the output layer is skipped by
    default because its logits are the most precision-sensitive values in the model. A MoE
    router (`feed_forward.gate`) always stays in high precision: top-k selection is where small
    errors flip decisions, and the layer reads its weight directly (models/moe.MoE.route).
    Grouped expert weights are not Linears and stay in high precision too.
    """

    def keep(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear) or any(f in fqn for f in filter_fqns):
            return False
        if fqn.endswith("feed_forward.gate"):
            return False
        return module.in_features % 16 == 0 and module.out_features % 16 == 0

    return keep


def check_float8_hardware(f8cfg, device_type: str) -> None:
    if f8cfg.enable and not (f8cfg.emulate or float8_supported(device_type)):
        raise ConfigError(
            f"float8.enable needs a CUDA GPU with compute capability 8.9+ (device here: "
            f"{device_type}); set float8.emulate = true to test the conversion without one, "
            "or float8.enable = false",
            "float8.enable",
        )


def apply_float8(model: nn.Module, f8cfg, device_type: str, fsdp_enabled: bool,
                 compiled: bool = False) -> list[str]:
    """Convert the model's eligible Linear layers in place; returns their names.

    `compiled`: whether the blocks will be torch.compile'd (compile.enable with "model").
    Without compile, the amax/scale/cast kernels run unfused and float8 is usually slower
    than bf16: a warning says so. With compile and rowwise scales, inductor must keep eager's
    bf16 rounding (`emulate_precision_casts`): otherwise the recomputation under activation
    checkpointing can differ from the forward and training diverges to NaN (pytorch#150859;
    TorchTitan sets the same flag, pytorch/torchtitan#1110). That flag is passed to the blocks'
    compile (`inductor_options`), not set on inductor's global config, so nothing else in the
    process (another model, a test) inherits it.
    """
    check_float8_hardware(f8cfg, device_type)
    if not compiled:
        logger.warning(
            "float8.enable without compile (compile.enable with 'model' in compile.components): "
            "the float8 casts run unfused, which is usually slower than bf16; enable compile"
        )
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    if f8cfg.recipe == "tensorwise":
        config = Float8LinearConfig(
            enable_fsdp_float8_all_gather=fsdp_enabled and f8cfg.enable_fsdp_float8_all_gather,
            emulate=f8cfg.emulate,
        )
    else:  # rowwise scales cannot be all-gathered in float8: FSDP gathers in param dtype
        config = dataclasses.replace(
            Float8LinearConfig.from_recipe_name(f8cfg.recipe), emulate=f8cfg.emulate
        )
    keep = float8_module_filter(f8cfg.filter_fqns)
    converted = [name for name, m in model.named_modules() if keep(m, name)]
    convert_to_float8_training(model, config=config, module_filter_fn=keep)
    return converted


def inductor_options(f8cfg) -> dict:
    """Inductor options the float8 recipe needs in the compiled blocks (see apply_float8)."""
    if f8cfg.enable and f8cfg.recipe != "tensorwise":
        return {"emulate_precision_casts": True}
    return {}


def uses_float8_all_gather(f8cfg, fsdp_enabled: bool) -> bool:
    return (f8cfg.enable and fsdp_enabled and f8cfg.recipe == "tensorwise"
            and f8cfg.enable_fsdp_float8_all_gather)


def register_float8_scale_precompute(optimizer, model: nn.Module, f8cfg, fsdp_enabled: bool):
    """With float8 all-gather, compute every weight's scale in one fused op after each step.

    Otherwise each FSDP unit computes its own amax (one small all-reduce per layer) at the next
    forward; precomputing batches them into a single all-reduce.
    """
    if not (uses_float8_all_gather(f8cfg, fsdp_enabled)
            and f8cfg.precompute_float8_dynamic_scale_for_fsdp):
        return None
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    return optimizer.register_step_post_hook(
        lambda *_: precompute_float8_dynamic_scale_for_fsdp(model)
    )
