"""Mutants of the resume read in one pass (issue 64): open -> fit -> read -> apply, where "fit"
runs the checks features register (torchllm/checkpoint/resume/fit.py, registered by
torchllm/checkpoint/fits.py), and checkpoint/resume imports no feature module."""

from __future__ import annotations

from mutants.base import Mutant

T = "tests/test_resume_fit.py::"

MUTANTS = [
    Mutant.at(
        "resume_imports_a_feature",
        "checkpoint/resume imports a feature (LoRA) again instead of running its registered check",
        "torchllm.checkpoint.resume.restore:Restore._fit",
        "        fit = Fit(step, self.cfg, self.run_info, resume, list(exclude))\n",
        "        from torchllm.models.lora import lora_fit  # noqa: F401\n"
        "        fit = Fit(step, self.cfg, self.run_info, resume, list(exclude))\n",
        (T + "test_checkpoint_resume_imports_no_feature_module",),
    ),
    Mutant.at(
        "fit_marker_checks_skipped",
        "the checks registered on the marker (batch, data identity) never run on a resume",
        "torchllm.checkpoint.resume.restore:Restore._fit",
        '        run_checks(fit, "marker")\n',
        "        pass\n",
        (T + "test_a_registered_fit_check_refuses_the_resume_in_one_line[marker]",),
    ),
    Mutant.at(
        "fit_states_checks_skipped",
        "the checks registered on the states to read (vocabulary, LoRA, family) never run",
        "torchllm.checkpoint.resume.restore:Restore._fit",
        '        run_checks(fit, "states")\n        return fit\n',
        "        return fit\n",
        (T + "test_a_registered_fit_check_refuses_the_resume_in_one_line[states]",),
    ),
    Mutant.at(
        "fit_checks_out_of_order",
        "a check registered later runs first (the family check no longer runs last)",
        "torchllm.checkpoint.resume.fit:register",
        "    CHECKS[phase].append((name, check))\n",
        "    CHECKS[phase].insert(0, (name, check))\n",
        (T + "test_the_features_checks_are_registered_wherever_checkpoint_is_imported",),
    ),
]
