"""What an error or log message must carry, not its sentence (issue 54).

A message's wording may change freely; what a user acts on may not: the key, file, value,
allowed values or command it names, and (for a ConfigError) the key it is raised for. So a test
asserts those, e.g.

    with raises_naming(ConfigError, "training.steps", "'four'", key="training.steps"):
        load(...)
    assert_names(r.stderr, "checkpoint.folder", str(path))
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest


def assert_names(message, *things) -> None:
    """`message` (a str, or anything str() of which is the message: an exception) names every one
    of `things` (each compared as str()); the failure shows what is missing and the message."""
    text = str(message)
    missing = [str(t) for t in things if str(t) not in text]
    assert not missing, f"the message does not name {missing}:\n{text}"


@contextmanager
def raises_naming(exc_type, *things, key: str | None = None, one_line: bool = False):
    """`pytest.raises(exc_type)` whose message names every one of `things`; with `key`, the
    exception's `.key` (ConfigError's: the config key it is raised for) is that key; with
    `one_line`, the message holds no newline. Yields pytest's ExceptionInfo."""
    with pytest.raises(exc_type) as info:
        yield info
    assert_names(info.value, *things)
    if key is not None:
        assert getattr(info.value, "key", None) == key, (info.value, getattr(info.value, "key", None))
    if one_line:
        assert "\n" not in str(info.value), str(info.value)


def launcher_lines(out: str, *words: str) -> list[str]:
    """The launcher's console lines (`run_train:`) that name every one of `words`."""
    return [line for line in out.splitlines()
            if line.startswith("run_train:") and all(w in line for w in words)]


def refused(ran, *things) -> str:
    """A command (tests/cli.py's Ran, or subprocess's CompletedProcess) refused in one line:
    exit 2, no traceback, and a console line naming every one of `things` (each compared as
    str()); returns that line."""
    out = ran.stdout + ran.stderr
    assert ran.returncode == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    lines = [line for line in out.splitlines() if all(str(t) in line for t in things)]
    assert lines, f"no line names {[str(t) for t in things]}:\n{out[-3000:]}"
    return lines[0]
