"""Mutants of issue 64's "builders take their section" in data/, models/, hf/, run/, eval/
(tests/test_config_coupling_data.py measures it with scripts/config_coupling.py)."""

from __future__ import annotations

from mutants.base import Mutant

T = "tests/test_config_coupling_data.py::"

MUTANTS = [
    Mutant.at(
        "chat_source_context_untyped",
        "the chat packing reads its sections off an untyped context again, as the sources' "
        "context carried the whole JobConfig (ctx.data read through a bag)",
        "torchllm.data.packing.chat:stream_chat_windows",
        "def stream_chat_windows(ds, ctx: Context):",
        "def stream_chat_windows(ds, ctx):",
        (T + "test_only_the_entry_points_of_data_models_hf_run_and_eval_take_the_whole_config",),
    ),
]
