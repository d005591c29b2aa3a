"""Mutants of the journey, round 6 (issue 63): numbers and messages that say what they are."""

from __future__ import annotations

from mutants.base import Mutant

ROUND6 = "tests/test_journey_round6.py::"

MUTANTS = [
    Mutant.at(
        "hub_refusal_said_as_timeout",
        "a Hub that refuses the connection at once is described as not answering within 3 s",
        "torchllm.hub:hub_reachable",
        '                _state["why"] = (f"did not answer within {timeout:g} s"\n'
        "                                 if isinstance(e, TimeoutError) else\n",
        '                _state["why"] = (f"did not answer within {timeout:g} s"\n'
        "                                 if True else\n",
        (f"{ROUND6}test_an_offline_hub_is_described_as_it_answered",),
    ),
    Mutant.at(
        "downstream_negative_zero", "the downstream table prints -0.0000 for a task at chance",
        "torchllm.eval.downstream:unsigned_zero",
        "    return round(value, digits) + 0.0 if round(value, digits) == 0 else value\n",
        "    return value\n",
        (f"{ROUND6}test_a_centered_accuracy_a_hair_below_chance_prints_as_zero",),
    ),
]
