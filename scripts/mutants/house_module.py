"""Mutants of the loop's seams (issue 64): the train module, the TrainContext callbacks read,
the batch's processed-token count and a family's loss path (scripts/mutation_check.py runs them)."""

from __future__ import annotations

from mutants.base import Mutant

SEAMS = "tests/test_train_seams.py::"

MUTANTS = [
    Mutant.at(
        "loop_hands_callbacks_the_trainer",
        "the loop hands each callback's on_step_end the Trainer instead of the TrainContext",
        "torchllm.train:Trainer.train",
        "report.update(cb.on_step_end(self.context, self.step, m))",
        "report.update(cb.on_step_end(self, self.step, m))",
        (SEAMS + "test_callbacks_receive_the_frozen_context_only",),
    ),
    Mutant.at(
        "report_reads_a_trainer_attribute",
        "the run report reads the Trainer's `evaluator` property instead of asking the context",
        "torchllm.report.hook:RunReport.on_step_end",
        "        evaluator = ctx.callback(Evaluator)\n",
        "        evaluator = ctx.evaluator\n",
        (SEAMS + "test_no_module_outside_the_loop_reads_the_trainer",),
    ),
    Mutant.at(
        "moe_loss_path_drops_the_aux_loss",
        "a MoE model's loss path is the token loss alone (the auxiliary losses never trained)",
        "torchllm.models.moe:family_loss",
        "    if not layers:\n",
        "    if True:\n",
        ("tests/test_qwen3.py::test_trainer_adds_the_weighted_aux_loss_to_the_gradient",),
    ),
    Mutant.at(
        "processed_tokens_count_chat_padding",
        "the loader counts a packed chat batch's padding as processed tokens",
        "torchllm.data.loader:CountedBatches.__next__",
        "processed_tokens(batch, self.packed_chat)",
        "processed_tokens(batch, False)",
        ("tests/test_data_chat.py::"
         "test_sft_throughput_counts_processed_tokens_and_trained_ones_apart",),
    ),
    Mutant.at(
        "train_module_state_without_the_schedule",
        "the train module's state leaves out the LR schedule",
        "torchllm.train_module:TrainModule._states",
        "TrainingState(self.pieces()).saved_states()",
        "TrainingState(self.pieces()[:2]).saved_states()",
        (SEAMS + "test_the_train_module_state_is_what_a_checkpoint_step_holds",),
    ),
]
