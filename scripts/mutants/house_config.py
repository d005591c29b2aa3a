"""Mutants of components owning their config (issue 64): [model] / [optimizer] validated
against the selected entry's own dataclass (torchllm/config/components.py, loader.py)."""

from __future__ import annotations

from mutants.base import Mutant

T = "tests/test_config_components.py::"

MUTANTS = [
    Mutant.at(
        "section_stays_the_default_entrys",
        "[model] / [optimizer] keep the default entry's dataclass whatever model.name / "
        "optimizer.name select: a family's own key (the toy family's mlp_ratio, qwen3's "
        "head_dim) is refused, the default family's accepted for every family",
        "torchllm.config.loader:_select_entries",
        "        setattr(cfg, section, components.select(section, obj))\n", "",
        (T + "test_a_family_in_tests_adds_a_shape_key_without_touching_config",
         T + "test_an_optimizers_own_key_is_accepted_where_it_is_selected"),
    ),
    Mutant.at(
        "entry_key_set_unchecked",
        "an entry's own key is set without checking it against the selected entry's "
        "dataclass: another optimizer's key passes silently, another family's is refused "
        "late, without naming the family that declares it",
        "torchllm.config.loader:_select_entries",
        "        _set(cfg, section, key, value, where, from_cli)\n",
        "        setattr(getattr(cfg, section), key, value)\n",
        (T + "test_a_familys_key_is_refused_where_another_family_is_selected",
         T + "test_an_optimizers_own_key_is_accepted_where_it_is_selected"),
    ),
]
