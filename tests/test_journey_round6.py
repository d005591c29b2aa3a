"""The journey, round 6 (issue 63): numbers and messages that say what they are."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

from cli import run_train
from conftest import REPO, tiny_args

import torchllm.hub as hub
from torchllm.eval.downstream import DownstreamResult, TaskResult


def documented_tags() -> list[re.Pattern]:
    """The tags of docs/metrics.md's table (`<group>` matching one path part)."""
    text = (REPO / "docs" / "metrics.md").read_text()
    tags = re.findall(r"^\| `([a-z_]+/[^`]+)` \|", text, re.M)
    return [re.compile(re.sub(r"<[^>]+>", "[^/]+", re.escape(t).replace(r"\<", "<")
                              .replace(r"\>", ">")) + "$") for t in tags]


def test_every_scalar_a_run_writes_is_in_the_metrics_docs_table(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    r = run_train(*tiny_args(tmp_path, "--training.steps=2", "--job.run_name=tags"))
    assert r.returncode == 0, r.out[-3000:]
    tags = set()
    for events in (tmp_path / "tb").rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    assert "loss/interval" in tags and "loss/avg" in tags, sorted(tags)
    patterns = documented_tags()
    missing = sorted(t for t in tags if not any(p.match(t) for p in patterns))
    assert not missing, f"TensorBoard tags missing from docs/metrics.md's table: {missing}"


def test_a_centered_accuracy_a_hair_below_chance_prints_as_zero():
    result = DownstreamResult({"copa": TaskResult("copa", "mc", 0, 10, 0.4999999, 0.5)})
    table = result.table()
    assert "-0.0000" not in table and "0.0000" in table, table


@pytest.fixture
def fresh_probe(monkeypatch):
    monkeypatch.setattr(hub, "_state", {})
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    for key in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "HF_HUB_OFFLINE",
                "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(key, raising=False)


def test_an_offline_hub_is_described_as_it_answered(fresh_probe, monkeypatch):
    # refused at once (nothing listens on port 9): not "did not answer within 3 s"
    assert not hub.hub_reachable()
    note = hub.offline_note(True)
    assert "could not be reached" in note and "within" not in note, note

    def times_out(*a, **k):
        raise socket.timeout("timed out")

    monkeypatch.setattr(hub, "_state", {})
    monkeypatch.setattr(socket, "create_connection", times_out)
    assert not hub.hub_reachable()
    assert "did not answer within 3 s" in hub.offline_note(True)
