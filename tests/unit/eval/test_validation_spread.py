"""A named validation set through the command a user types (issue 63, item 6):

    ./run_train.sh --data.dataset=local:novel.txt --validation.dataset=local:val.txt ...

The automatic budget scores a few dozen windows of a 100,000-byte set: they are spread evenly
over all of it (not its first 2,300 tokens), the header says how many of how many, and the
TensorBoard tags name the set (val/val.txt/loss; val/loss is the held-out split's curve), each
documented in docs/metrics.md's table; the report still draws and summarizes it.
"""

from __future__ import annotations

import re
import pytest

from cli import run_module, run_train
from conftest import tb_scalars
from builders.docs import documented_tags
from builders.data import ARGS, SEQ, header_validation, texts

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spread")
    novel, val = texts(tmp)
    r = run_train(f"--job.dump_folder={tmp}", "--job.run_name=r", f"--data.dataset=local:{novel}",
                  f"--validation.dataset=local:{val}", *ARGS, "--training.steps=4")
    assert r.returncode == 0, r.out[-4000:]
    return tmp, r.out


def test_a_named_set_is_scored_on_windows_spread_over_all_of_it(run):
    tmp, out = run
    val = header_validation(out)
    m = re.search(r"validation local:(\S+): ([\d,]+) tokens scored in ([\d,]+) windows, spread "
                  r"evenly over all its ([\d,]+) windows \(([\d,]+) tokens\): "
                  r"validation.max_tokens = 0", val)
    assert m, val
    tokens, scored, windows, total = (int(g.replace(",", "")) for g in m.groups()[1:])
    size = len((tmp / "val.txt").read_bytes()) + 2  # bytes tokenizer: BOS + text + EOS
    # all of the file is the set: its every token and window counted, a few dozen scored
    assert m.group(1) == str(tmp / "val.txt") and total == size
    assert windows == size // (SEQ + 1) and tokens == scored * SEQ and 0 < scored < windows // 10
    # each validation scored what the header said, and its console line names the set
    lines = re.findall(r"validation step \d+: loss [\d.]+ \| perplexity [\d.]+ \| ([\d,]+) "
                       r"tokens of local:(\S+) \(val/val.txt/loss\)", out)
    assert lines and all(int(n.replace(",", "")) == tokens and where == str(tmp / "val.txt")
                         for n, where in lines), out[-3000:]


def test_its_tensorboard_tags_name_it_and_are_documented(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tmp, out = run
    tags = set()
    for events in (tmp / "tb").rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    named = {"val/val.txt/loss", "val/val.txt/perplexity", "val/val.txt/tokens"}
    assert named <= tags and "val/loss" not in tags, sorted(tags)
    patterns = documented_tags()
    assert all(any(p.match(t) for p in patterns) for t in named), named
    last = re.findall(r"validation step 4: loss ([\d.]+) \|", out)[-1]
    assert f"{tb_scalars(tmp / 'tb' / 'r', 'val/val.txt/loss')[4]:.4f}" == last


def test_the_report_draws_and_summarizes_a_named_set(run):
    """python -m torchllm.report RUN: the loss plot has the set's curve, the summary its loss."""
    tmp, out = run
    r = run_module("torchllm.report", str(tmp / "r"), "--out", str(tmp / "report"))
    assert r.returncode == 0 and "loss.png" in r.out, r.out[-3000:]
    md = next((tmp / "report").glob("*.md")).read_text()
    last = re.findall(r"validation step 4: loss ([\d.]+) \|", out)[-1]
    row = next(line for line in md.splitlines() if "final validation loss" in line)
    got = re.search(r"([\d.]+) \(step 4\)", row)
    assert got and float(got.group(1)) == pytest.approx(float(last), abs=2e-4), row
