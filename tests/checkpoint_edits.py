"""Edits a test makes to a saved checkpoint step, as an attacker or a bad disk would (shared by
test_checkpoint_step, test_checkpoint_trust and test_edge_untrusted)."""

from __future__ import annotations

import json
from pathlib import Path

from torchllm.checkpoint.index import INDEX
from torchllm.checkpoint.integrity import folder_checksums
from torchllm.checkpoint.layout import MARKER


def reseal(step: Path) -> None:
    """Record the files' current sizes and CRC-32s in COMPLETE, as a careful attacker would."""
    record = json.loads((step / MARKER).read_text())
    record["files"] = folder_checksums(step)
    (step / MARKER).write_text(json.dumps(record))


def edit_index(step: Path, change) -> Path:
    """Apply `change` to the step's JSON index, reseal, and return the index's path."""
    index = json.loads((step / INDEX).read_text())
    change(index)
    (step / INDEX).write_text(json.dumps(index))
    reseal(step)
    return step / INDEX
