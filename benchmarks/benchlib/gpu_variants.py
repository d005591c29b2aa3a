"""benchmarks/bench_gpu.py's variants: each a name for config overrides applied on top of the
run's shape, with the few that also change the shape (micro-steps, AC, sequence length) and
those that need CUDA (refused on CPU in one line, naming what works instead)."""

VARIANTS = {
    "bf16_compile": ["--training.mixed_precision=bf16", "--compile.enable=true",
                     "--float8.enable=false"],
    "bf16_compile_float8": ["--training.mixed_precision=bf16", "--compile.enable=true",
                            "--float8.enable=true", "--float8.recipe=tensorwise"],
    "bf16": ["--training.mixed_precision=bf16", "--compile.enable=false", "--float8.enable=false"],
    "fp32": ["--training.mixed_precision=none", "--compile.enable=false", "--float8.enable=false"],
    "bf16_compile_float8_rowwise": ["--training.mixed_precision=bf16", "--compile.enable=true",
                                    "--float8.enable=true", "--float8.recipe=rowwise"],
    "bf16_compile_ac_selective": ["--training.mixed_precision=bf16", "--compile.enable=true",
                                  "--float8.enable=false"],
    "bf16_compile_seq4096": ["--training.mixed_precision=bf16", "--compile.enable=true",
                             "--float8.enable=false"],
    "bf16_compile_seq8192": ["--training.mixed_precision=bf16", "--compile.enable=true",
                             "--float8.enable=false"],
}
# The speed levers (docs/gpu.md, "Speed levers"): each beside the row it changes. The accum4
# rows run 4 micro-steps per optimizer step (global batch = 4 x local), where the eager float32
# gradient accumulation of the first H200 profile shows.
BF16_COMPILE = VARIANTS["bf16_compile"]
VARIANTS.update({
    "bf16_compile_accum4": BF16_COMPILE,
    "bf16_compile_accum4_cast_once": [*BF16_COMPILE, "--training.cast_weights_once=true"],
    "bf16_compile_cast_once": [*BF16_COMPILE, "--training.cast_weights_once=true"],
    "bf16_compile_chunked_loss": [*BF16_COMPILE, "--training.chunked_loss=true"],
    "bf16_compile_liger_loss": [*BF16_COMPILE, "--training.chunked_loss=true",
                                "--training.chunked_loss_impl=liger"],
    "bf16_compile_model": [*BF16_COMPILE, "--compile.granularity=model"],
    "bf16_compile_cudagraphs": [*BF16_COMPILE, "--compile.cudagraphs=true"],
    "bf16_compile_model_cudagraphs": [*BF16_COMPILE, "--compile.granularity=model",
                                      "--compile.cudagraphs=true"],
    "bf16_compile_accum4_cudagraphs": [*BF16_COMPILE, "--compile.cudagraphs=true"],
    **{f"bf16_compile_sdpa_{b}": [*BF16_COMPILE, f"--model.sdpa_backend={b}"]
       for b in ("cudnn", "flash", "efficient", "math")},
    "bf16_compile_flex": [*BF16_COMPILE, "--model.attention=flex"],
})
VARIANT_ACCUM = {"bf16_compile_accum4": 4, "bf16_compile_accum4_cast_once": 4,
                 "bf16_compile_accum4_cudagraphs": 4}
VARIANT_AC = {"bf16_compile_ac_selective": "selective"}  # fixed, whatever --ac says
VARIANT_SEQ = {"bf16_compile_seq4096": 4096, "bf16_compile_seq8192": 8192}
CUDA_ONLY = {"bf16_compile_float8": "float8 matmuls", "bf16_compile_float8_rowwise":
             "float8 matmuls", "bf16_compile_liger_loss": "liger-kernel's Triton loss",
             "bf16_compile_cudagraphs": "CUDA graphs", "bf16_compile_model_cudagraphs":
             "CUDA graphs", "bf16_compile_accum4_cudagraphs": "CUDA graphs",
             "bf16_compile_sdpa_cudnn": "cuDNN attention",
             "bf16_compile_sdpa_efficient": "memory-efficient attention",
             "bf16_compile_flex": "FlexAttention"}
CPU_VARIANTS = [v for v in VARIANTS if v not in CUDA_ONLY]
