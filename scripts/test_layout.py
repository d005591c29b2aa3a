"""Where each test module lives under tests/ (issue 64, "tests laid out like the package").

    python scripts/test_layout.py            # git mv every test_*.py to its folder in LAYOUT
    python scripts/test_layout.py --dry-run  # print the moves, change nothing
    python scripts/test_layout.py --check    # exit 1 naming each file out of place, and each
                                             # row whose file is gone (no move)

The folders (tests/README.md, "Layout"):
  unit/<package>/  one package of torchllm/ (unit/ itself: the modules torchllm/*.py), and
                   unit/benchmarks/ for benchmarks/: in one process, or a tiny run of the
                   user's command in-process (tests/cli.py) where that package is the subject
  integration/     several ranks or processes together (gloo ranks, torchrun launches, an S3
                   server), the golden curves and the CUDA paths of every package
  e2e/             what users type, where the process is the subject (run_train.sh and its
                   launcher, the docs' commands, a fresh clone, offline, the journey)
  suite/           the suite's own machinery (conftest's guard, scripts/mutation_check.py, this)

A new test module goes in one row of LAYOUT (its basename: its folder); run this script and it
is moved. A test_*.py that no row names is an error naming the file and the folders to choose
from, before anything moves. Basenames stay unique across tests/ (pytest imports each test
module by its basename, and scripts/mutation_check.py resolves a test id `tests/test_x.py::t`
by it). A module that finds files next to itself (`Path(__file__).parent`, `parents[1]`) is
named after its move: it now sits deeper, so check those paths.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
TIERS = ("unit", "integration", "e2e", "suite")

LAYOUT = {
    # unit/: torchllm/*.py (train, train_module, callbacks, device, generate, precision, storage,
    # store, ...) and what checks the package as a whole
    "test_train.py": "unit",
    "test_train_seams.py": "unit",
    "test_host_syncs.py": "unit",
    "test_nonfinite_check.py": "unit",
    "test_cuda_paths.py": "unit",
    "test_precision.py": "unit",
    "test_generate.py": "unit",
    "test_generate_interactive.py": "unit",
    "test_storage_leaf.py": "unit",
    "test_store.py": "unit",
    "test_store_errors.py": "unit",
    "test_edge_files.py": "unit",
    "test_torch_apis.py": "unit",
    # unit/benchmarks: benchmarks/ and the GPU tests' harness
    "test_bench.py": "unit/benchmarks",
    "test_bench_memory.py": "unit/benchmarks",
    "test_bench_revisions.py": "unit/benchmarks",
    "test_time_to_loss.py": "unit/benchmarks",
    "test_gpu_harness.py": "unit/benchmarks",
    # unit/checkpoint
    "test_checkpoint.py": "unit/checkpoint",
    "test_checkpoint_faults.py": "unit/checkpoint",
    "test_checkpoint_step.py": "unit/checkpoint",
    "test_checkpoint_trust.py": "unit/checkpoint",
    "test_edge_untrusted.py": "unit/checkpoint",
    "test_identity_trust.py": "unit/checkpoint",
    "test_resume_data_reads.py": "unit/checkpoint",
    "test_resume_fit.py": "unit/checkpoint",
    "test_training_state.py": "unit/checkpoint",
    "test_resume_safety.py": "unit/checkpoint",
    "test_resume_trust.py": "unit/checkpoint",
    "test_stage_boundaries.py": "unit/checkpoint",
    "test_vocab_rows.py": "unit/checkpoint",
    # unit/config
    "test_config.py": "unit/config",
    "test_config_components.py": "unit/config",
    # unit/data
    "test_data.py": "unit/data",
    "test_data_chat.py": "unit/data",
    "test_data_file_edges.py": "unit/data",
    "test_data_howto.py": "unit/data",
    "test_data_kinds.py": "unit/data",
    "test_data_mixture.py": "unit/data",
    "test_data_row_errors.py": "unit/data",
    "test_data_safety.py": "unit/data",
    "test_chat_isolation.py": "unit/data",
    "test_chat_stream.py": "unit/data",
    "test_chat_template.py": "unit/data",
    "test_chat_template_limits.py": "unit/data",
    "test_local_text_bom.py": "unit/data",
    "test_prepare_split.py": "unit/data",
    "test_stage_tokenizer.py": "unit/data",
    "test_tokenizer.py": "unit/data",
    "test_tokenizer_text.py": "unit/data",
    # unit/eval
    "test_eval_continuation.py": "unit/eval",
    "test_eval_downstream.py": "unit/eval",
    "test_eval_fetch_swap.py": "unit/eval",
    "test_eval_hellaswag.py": "unit/eval",
    "test_eval_loading.py": "unit/eval",
    "test_eval_loss.py": "unit/eval",
    "test_eval_validation.py": "unit/eval",
    "test_harness.py": "unit/eval",
    "test_validation_dataset.py": "unit/eval",
    "test_validation_off.py": "unit/eval",
    "test_validation_set.py": "unit/eval",
    "test_validation_spread.py": "unit/eval",
    # unit/ft
    "test_fault_tolerance.py": "unit/ft",
    "test_ft_heal_data.py": "unit/ft",
    "test_ft_one_run.py": "unit/ft",
    "test_ft_public.py": "unit/ft",
    "test_ft_semi_sync.py": "unit/ft",
    "test_ft_streaming.py": "unit/ft",
    # unit/hf
    "test_edge_hf.py": "unit/hf",
    "test_hf_export.py": "unit/hf",
    "test_hf_import_checks.py": "unit/hf",
    "test_hf_parity.py": "unit/hf",
    "test_hf_tokenizer_export.py": "unit/hf",
    # unit/metrics
    "test_metrics.py": "unit/metrics",
    "test_cpu_peak.py": "unit/metrics",
    "test_header_fixes.py": "unit/metrics",
    "test_run_header.py": "unit/metrics",
    "test_moe_counts.py": "unit/metrics",
    # unit/models
    "test_attention.py": "unit/models",
    "test_gpt2.py": "unit/models",
    "test_lora.py": "unit/models",
    "test_lora_tokens.py": "unit/models",
    "test_model.py": "unit/models",
    "test_model_contract.py": "unit/models",
    "test_model_family_plugin.py": "unit/models",
    "test_model_shapes.py": "unit/models",
    "test_moe_balancing.py": "unit/models",
    "test_moe_memory.py": "unit/models",
    "test_moe_training.py": "unit/models",
    "test_qwen3.py": "unit/models",
    "test_speed_paths.py": "unit/models",
    # unit/optim
    "test_muon_ns_dtype.py": "unit/optim",
    "test_optimizer_plugin.py": "unit/optim",
    "test_recipes.py": "unit/optim",
    # unit/parallel
    "test_context_parallel.py": "unit/parallel",
    "test_expert_parallel.py": "unit/parallel",
    "test_parallel.py": "unit/parallel",
    "test_pipeline.py": "unit/parallel",
    "test_speed_levers.py": "unit/parallel",
    # unit/report
    "test_report.py": "unit/report",
    # unit/run
    "test_process_exit.py": "unit/run",
    "test_run_safety.py": "unit/run",
    "test_runlock.py": "unit/run",
    "test_stop_at_loss.py": "unit/run",
    # unit/tools
    "test_cluster_tools.py": "unit/tools",
    "test_estimate_memory.py": "unit/tools",
    "test_estimate_memory_recorded.py": "unit/tools",
    "test_estimate_memory_cli.py": "unit/tools",
    "test_estimate_memory_cuda.py": "unit/tools",
    # integration/
    "test_ft_ddp_heal.py": "integration",
    "test_ft_fsdp_heal.py": "integration",
    "test_ft_overlap.py": "integration",
    "test_ft_semi_sync_heal.py": "integration",
    "test_checkpoint_dist.py": "integration",
    "test_comm_timeout.py": "integration",
    "test_eval_distributed.py": "integration",
    "test_expert_parallel_checkpoint.py": "integration",
    "test_fsdp_rope.py": "integration",
    "test_golden_curves.py": "integration",
    "test_gpu.py": "integration",
    "test_memory_scaling.py": "integration",
    "test_metrics_dist.py": "integration",
    "test_object_storage.py": "integration",
    "test_parallel_multiprocess.py": "integration",
    "test_recipes_parallel.py": "integration",
    # e2e/
    "test_clear_errors.py": "e2e",
    "test_console.py": "e2e",
    "test_docs_commands.py": "e2e",
    "test_fresh_clone.py": "e2e",
    "test_journey.py": "e2e",
    "test_journey_round6.py": "e2e",
    "test_launch_path.py": "e2e",
    "test_launch_security.py": "e2e",
    "test_launcher.py": "e2e",
    "test_offline.py": "e2e",
    "test_train_configs.py": "e2e",
    "test_unclear_errors.py": "e2e",
    # suite/
    "test_mutation_check.py": "suite",
    "test_config_coupling.py": "suite",
    "test_config_coupling_data.py": "suite",
    "test_suite_guard.py": "suite",
    "test_tests_layout.py": "suite",
    "test_xdist_order.py": "suite",
}


def folders() -> list[str]:
    """The folders LAYOUT uses and the package folders a new row may name."""
    packages = [f"unit/{p.name}" for p in sorted((REPO / "torchllm").iterdir())
                if (p / "__init__.py").is_file()]
    return sorted(set(LAYOUT.values()) | set(packages) | set(TIERS))


def test_modules(root: Path = TESTS) -> list[Path]:
    """Every test_*.py under tests/, except inside data folders (golden/, data/, ...: none hold
    test modules) and caches."""
    return sorted(p for p in root.rglob("test_*.py") if "__pycache__" not in p.parts)


def problems(root: Path = TESTS, layout: dict[str, str] = LAYOUT) -> list[str]:
    """One line per file out of place: a basename twice, a file no row names, a file not in
    its row's folder (a flat tests/test_*.py included), and a row whose file is gone."""
    lines = []
    seen: dict[str, Path] = {}
    for path in test_modules(root):
        rel = path.relative_to(root)
        if path.name in seen:
            lines.append(f"tests/{rel}: basename also at tests/{seen[path.name]} (pytest imports "
                         f"test modules by basename: rename one)")
            continue
        seen[path.name] = rel
        if path.name not in layout:
            lines.append(unknown(rel))
        elif rel.parent.as_posix() != layout[path.name]:
            lines.append(f"tests/{rel}: LAYOUT places it in tests/{layout[path.name]}/ (run "
                         f"python scripts/test_layout.py to move it)")
    for name in sorted(set(layout) - set(seen)):  # a removed or renamed module's row
        lines.append(f"scripts/test_layout.py: LAYOUT's row \"{name}\": \"{layout[name]}\" "
                     f"names no file under tests/ (removed or renamed): drop or rename the row")
    return lines


def unknown(rel: Path) -> str:
    return (f"tests/{rel}: no row in LAYOUT (scripts/test_layout.py); add "
            f"\"{rel.name}\": \"<folder>\" with the folder by what it tests, one of: "
            f"{', '.join(folders())}")


def moves(root: Path = TESTS, layout: dict[str, str] = LAYOUT) -> tuple[list[tuple[Path, Path]],
                                                                        list[str]]:
    """(source, destination) for each file not yet in its folder, and the errors that stop any
    move (an unknown file, a basename twice, a destination taken)."""
    planned, errors, seen = [], [], {}
    for path in test_modules(root):
        rel = path.relative_to(root)
        if path.name in seen:
            errors.append(f"tests/{rel}: basename also at tests/{seen[path.name]}: rename one")
            continue
        seen[path.name] = rel
        if path.name not in layout:
            errors.append(unknown(rel))
            continue
        dest = root / layout[path.name] / path.name
        if dest != path:
            planned.append((path, dest))
    return planned, errors


def git_mv(source: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    tracked = subprocess.run(["git", "ls-files", "--error-unmatch", str(source)], cwd=REPO,
                             capture_output=True).returncode == 0
    if tracked:
        subprocess.run(["git", "mv", str(source), str(dest)], cwd=REPO, check=True)
    else:
        source.rename(dest)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 naming every file out of place; move nothing")
    parser.add_argument("--dry-run", action="store_true", help="print the moves; move nothing")
    args = parser.parse_args(argv)
    if args.check:
        lines = problems()
        for line in lines:
            print(line, file=sys.stderr)
        print(f"{len(test_modules())} test modules, {len(lines)} out of place")
        return 1 if lines else 0
    planned, errors = moves()
    if errors:
        for line in errors:
            print(line, file=sys.stderr)
        print(f"nothing moved: {len(errors)} file(s) to place first", file=sys.stderr)
        return 2
    for source, dest in planned:
        print(f"{'would move' if args.dry_run else 'git mv'} {source.relative_to(REPO)} -> "
              f"{dest.relative_to(REPO)}")
        if not args.dry_run:
            git_mv(source, dest)
            if "__file__" in dest.read_text():
                print(f"  note: {dest.relative_to(REPO)} reads paths from __file__; it now sits "
                      f"in tests/{dest.parent.relative_to(TESTS)}/: check them")
    print(f"{len(planned)} file(s) {'to move' if args.dry_run else 'moved'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
