"""run_train.sh on a terminal: the progress bar docs/metrics.md promises (several ranks: drawn by
the launcher from rank 0's step; one process: by the trainer, which runs in the launcher's
process), with the log lines intact."""

import fcntl
import os
import pty
import re
import struct
import subprocess
import termios

import pytest

from conftest import REPO, tiny_args


pytestmark = pytest.mark.e2e  # run_train.sh on a terminal: the launcher's process


@pytest.mark.slow
@pytest.mark.parametrize("ngpu", [2, 1])
def test_run_train_sh_draws_the_bar_on_a_pseudo_terminal(tmp_path, ngpu):
    master, slave = pty.openpty()
    # A terminal's size (a bare pty has 0 x 0, where tqdm sized to it draws nothing).
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    env = {**os.environ, "NGPU": str(ngpu), "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(["./run_train.sh", *tiny_args(tmp_path, "--training.steps=30",
                                                          "--training.local_batch_size=2",
                                                          "--metrics.log_freq=10")],
                            cwd=REPO, env=env, stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the terminal's last writer is gone
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.wait(timeout=60) == 0, b"".join(chunks)[-3000:]
    text = b"".join(chunks).decode("utf-8", "replace")
    bars = re.findall(r"\r\[[#.]{30}\] (\d+)/30 \d+% ETA (?:\?|\d\d:\d\d)", text)
    assert bars, text[-3000:]
    assert all(1 <= int(s) <= 30 for s in bars)
    # Each relayed line starts on a cleared row: no bar glued in front of a step line.
    steps = [ln for ln in text.replace("\r\n", "\n").split("\n") if "| loss " in ln]
    assert len(steps) == 4, steps  # steps 1, 10, 20, 30
    for ln in steps:
        last = ln.split("\r")[-1].removeprefix("\x1b[K")
        # (torchrun's prefix on a worker's lines; one process writes its own)
        assert last.startswith("[rank0]:" if ngpu > 1 else "") and "| loss " in last, repr(ln)
        assert re.match(r"(\[rank0\]:)?\d\d:\d\d:\d\d step ", last), repr(ln)
