"""Mutants of parallelism: FSDP2/DDP/TP/PP/CP/EP, compile, float8, speed levers (scripts/mutation_check.py runs them)."""

from __future__ import annotations

from mutants.base import Mutant

MUTANTS = [
    Mutant.at(
        "comm_hook_not_registered", "parallelism.ddp_comm_hook is accepted but never registered",
        "torchllm.parallel.data_parallel:apply_ddp",
        "        model.register_comm_hook(dp_mesh.get_group(), hook)",
        "        pass",
        ("tests/test_parallel_multiprocess.py::test_fp16_comm_hook_is_registered_and_reduces_in_fp16",),
    ),
    Mutant.at(
        "cast_once_overwrites_grad", "cast_weights_once: a micro-step's bf16 gradient replaces the float32 gradient instead of adding to it",
        "torchllm.parallel.cast_once:_accumulate",
        "    if master.grad is None:\n        master.grad = grad.to(master.dtype)",
        "    if True:\n        master.grad = grad.to(master.dtype)",
        ("tests/test_speed_levers.py::test_cast_weights_once_equals_autocast_over_micro_steps_and_steps[False]",),
    ),
    Mutant.at(
        "cast_once_stale_copies", "cast_weights_once: the bf16 copies are made once, not refreshed after each optimizer step",
        "torchllm.parallel.cast_once:CastWeightsOnce.__call__",
        "        with torch.no_grad():\n            torch._foreach_copy_(",
        "        with torch.no_grad():\n            self.copied = getattr(self, \"copied\", 0) + 1\n            self.copied > 1 or torch._foreach_copy_(",
        ("tests/test_speed_levers.py::test_cast_weights_once_equals_autocast_over_micro_steps_and_steps[False]",),
    ),
    Mutant.at(
        "cudagraph_grads_not_owned", "compile.cudagraphs: the first gradient of a step stays the graph's output memory",
        "torchllm.parallel.levers:OwnGradients._own",
        "            p.grad = p.grad.clone()\n",
        "            pass\n",
        ("tests/test_speed_levers.py::test_own_gradients_copies_the_first_gradient_of_a_step_once",),
    ),
    Mutant.at(
        "sdpa_backend_ignored", "model.sdpa_backend is accepted but never applied",
        "torchllm.parallel.levers:sdpa_context",
        "    if backend == \"auto\":\n        return contextlib.nullcontext()",
        "    if True:\n        return contextlib.nullcontext()",
        ("tests/test_speed_levers.py::test_sdpa_backend_picks_the_kernel[math-False]",),
    ),
    Mutant.at(
        "compile_granularity_ignored", "compile.granularity = 'model' still compiles block by block",
        "torchllm.parallel.compile:apply_compile",
        "    if getattr(ccfg, \"granularity\", \"block\") == \"model\":",
        "    if False:",
        ("tests/test_speed_levers.py::test_compile_granularity_compiles_the_model_or_each_block",),
    ),
    Mutant.at(
        "cudagraphs_allowed_on_cpu", "compile.cudagraphs on CPU is not refused (inductor would fail later, or silently do nothing)",
        "torchllm.parallel.levers:check_levers",
        "        if device_type != \"cuda\":\n            raise ConfigError(\n                \"compile.cudagraphs",
        "        if False:\n            raise ConfigError(\n                \"compile.cudagraphs",
        ("tests/test_speed_levers.py::test_gpu_only_levers_are_refused_on_cpu_in_one_line[extra1-leave it false]",),
    ),
    Mutant.at(
        "missing_tp_plan_not_refused", "a family that declares no TP plan is run under TP anyway",
        "torchllm.parallel.parallelize:build_parallel_dims",
        "    if dims.tp_enabled and spec.tp_plan is None:",
        "    if False and spec.tp_plan is None:",
        ("tests/test_model_family_plugin.py::"
         "test_a_family_without_a_tp_plan_refuses_tensor_parallelism",),
    ),
]
