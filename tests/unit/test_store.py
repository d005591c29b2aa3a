"""torchllm.store: the one confined place for files torchllm did not create (issue 61)."""

from __future__ import annotations

import os

import pytest

from torchllm.store import Confined, Store, plain_parts


@pytest.fixture
def root(tmp_path):
    (tmp_path / "outside.txt").write_text("secret")
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("hi")
    os.symlink(tmp_path / "outside.txt", root / "link")
    os.symlink("..", root / "up")
    os.mkfifo(root / "fifo")
    return root


@pytest.mark.parametrize("name", ["../outside.txt", "/etc/passwd", "a/../../x", "", "a\\b",
                                  "a\x00b", "./a.txt"])
def test_names_that_lead_out_are_refused(name):
    with pytest.raises(Confined):
        plain_parts(name)


def test_reads_follow_no_link_and_never_open_a_fifo(root):
    store = Store(root)
    assert store.read_text("a.txt") == "hi"
    assert store.files() == {"a.txt": 2}  # links and the FIFO left out
    assert store.entries() == {"a.txt": "file", "sub": "folder", "link": "link", "up": "link",
                               "fifo": "fifo"}
    for name, what in (("link", "link"), ("up/outside.txt", "link"), ("fifo", "FIFO"),
                       ("sub", "folder")):
        with pytest.raises(Confined, match=what) as e:
            store.read_bytes(name)
        assert str(root / name.split("/")[0]) in str(e.value)


def test_a_read_is_bounded_before_it_reads(root):
    with pytest.raises(Confined, match="2 bytes, more than the 1 allowed"):
        Store(root).read_bytes("a.txt", max_bytes=1)


def test_a_write_replaces_a_link_never_its_target(root):
    store = Store(root)
    store.write_text("link", "mine")
    assert (root.parent / "outside.txt").read_text() == "secret"
    assert store.kind("link") == "file" and store.read_text("link") == "mine"
    assert not [p for p in os.listdir(root) if p.endswith(".tmp")]
    with pytest.raises(Confined, match="symbolic link"):
        store.write_text("up/outside.txt", "x")
    assert (root.parent / "outside.txt").read_text() == "secret"


def test_remove_deletes_the_entry_only(root):
    store = Store(root)
    store.remove("up")
    store.remove("link")
    assert (root.parent / "outside.txt").read_text() == "secret"
    assert os.path.isdir(root.parent)
    assert set(store.entries()) == {"a.txt", "sub", "fifo"}
