"""torchllm.run.process_exit.exit_process: the exit code, and nothing buffered is lost (stdout to a
pipe is block-buffered, and os._exit alone would drop it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

SCRIPT = """
import sys
from torchllm.run.process_exit import exit_process
print("printed before exit", end="")
sys.stderr.write("stderr before exit")
exit_process(3)
print("never")
"""


def test_exit_process_keeps_code_and_flushes():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # buffered, as usual
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3
    assert proc.stdout == "printed before exit"
    assert "stderr before exit" in proc.stderr
