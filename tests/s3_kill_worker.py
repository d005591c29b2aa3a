"""Run by tests/integration/test_object_storage.py: train in one process with
checkpoint.local_mirror, and stop the upload of step 4 half-way (its first file uploaded, then
SENTINEL written, then a wait for the test's kill -9).

    python tests/s3_kill_worker.py SENTINEL [--section.key=value ...]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from torchllm.checkpoint.resume import mirror
from torchllm.config import load_config
from torchllm.storage import join, storage_for
from torchllm.train import Trainer

upload = mirror.Mirror.upload


def half_upload(self, written, step, remote):
    if step != 4:
        return upload(self, written, step, remote)
    written.result()
    name = self.mine(self.step_dir(step))[0]
    storage_for(remote).upload(self.step_dir(step) / name, join(remote, name))
    Path(sys.argv[1]).write_text(name)
    time.sleep(600)


if __name__ == "__main__":
    mirror.Mirror.upload = half_upload
    Trainer(load_config(sys.argv[2:])).train()
