"""The planted bugs of scripts/mutation_check.py, one module per area of the code (by the file
each patches). A new mutant goes at the end of its area's MUTANTS list."""

from __future__ import annotations

from mutants import training
from mutants import config
from mutants import models
from mutants import data
from mutants import parallel
from mutants import checkpoint
from mutants import hf
from mutants import metrics
from mutants import eval
from mutants import run
from mutants import tools
from mutants import journey
from mutants import ft
from mutants import journey6
from mutants import edge_hf
from mutants import edge_data
from mutants import edge_ft
from mutants import edge_files
from mutants import edge_untrusted
from mutants import edge_chat
from mutants import memory_product
from mutants import memory_estimate
from mutants import memory_measure
from mutants import ft_heal
from mutants import valset
from mutants import session68
from mutants import session69
from mutants import house_config
from mutants import ft_api
from mutants import ft_semi_sync
from mutants import house_module
from mutants import house_resume
from mutants import house_config_b
from mutants import ft_overlap
from mutants import suite_trim
from mutants import house_state
from mutants import house_config_a
from mutants import memory_ep
from mutants import house_layout
from mutants import ft_ddp
from mutants import house_cfg2
from mutants import ft_sync2
from mutants import suite_trim2
from mutants import ft_fragments_heal
from mutants.base import Mutant

MUTANTS = [
    *training.MUTANTS,
    *config.MUTANTS,
    *models.MUTANTS,
    *data.MUTANTS,
    *parallel.MUTANTS,
    *checkpoint.MUTANTS,
    *hf.MUTANTS,
    *metrics.MUTANTS,
    *eval.MUTANTS,
    *run.MUTANTS,
    *tools.MUTANTS,
    *journey.MUTANTS,
    *ft.MUTANTS,
    *journey6.MUTANTS,
    *edge_hf.MUTANTS,
    *edge_data.MUTANTS,
    *edge_ft.MUTANTS,
    *edge_files.MUTANTS,
    *edge_untrusted.MUTANTS,
    *edge_chat.MUTANTS,
    *memory_product.MUTANTS,
    *memory_estimate.MUTANTS,
    *memory_measure.MUTANTS,
    *ft_heal.MUTANTS,
    *valset.MUTANTS,
    *session68.MUTANTS,
    *session69.MUTANTS,
    *house_config.MUTANTS,
    *ft_api.MUTANTS,
    *ft_semi_sync.MUTANTS,
    *house_module.MUTANTS,
    *house_resume.MUTANTS,
    *house_config_b.MUTANTS,
    *ft_overlap.MUTANTS,
    *suite_trim.MUTANTS,
    *house_state.MUTANTS,
    *house_config_a.MUTANTS,
    *memory_ep.MUTANTS,
    *house_layout.MUTANTS,
    *ft_ddp.MUTANTS,
    *house_cfg2.MUTANTS,
    *ft_sync2.MUTANTS,
    *suite_trim2.MUTANTS,
    *ft_fragments_heal.MUTANTS,
]
__all__ = ["MUTANTS", "Mutant"]
