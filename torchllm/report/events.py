"""What a run left behind, read back for its report: config, TensorBoard events, run info.

A run folder (`job.dump_folder/<run name>`) holds `config.toml` (the effective config),
`train.log`, `checkpoint/step-N` and, from the report hook, `report/run.json` (header, hardware,
wall time, validation losses). Its TensorBoard events sit in `job.dump_folder/<metrics.tb_folder>/
<run name>` (`rank_0/` under `metrics.rank_0_only = false`). A resumed run's later launch hides
what an earlier one logged after its checkpoint (TensorBoard's purge, honoured here too).

A run folder may be someone else's: its files are read through a torchllm.store.Store of it
(a link or FIFO among config.toml, report/run.json and the events files is refused, naming
it: `Confined`; each read bounded by MAX_BYTES), and what they say is data (the config never
imports code; the text is escaped where the report shows it: markdown.one_line).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from torchllm.config import ConfigError, JobConfig, load_config
from torchllm.store import NOT_REGULAR, Confined, Store

RUN_INFO = "run.json"  # in RUN/report/
TOKENS_TAG = "progress/tokens_seen"  # written by the report hook on logging/validation steps
INFO_NAME = f"report/{RUN_INFO}"  # in the run folder
MAX_BYTES = 16 << 20  # config.toml, run.json: larger is no file a run wrote
EVENTS = "events.out.tfevents."


@dataclass
class Series:
    steps: np.ndarray
    values: np.ndarray

    def last(self) -> tuple[int, float]:
        return int(self.steps[-1]), float(self.values[-1])

    def best(self) -> tuple[int, float]:
        i = int(np.nanargmin(self.values))
        return int(self.steps[i]), float(self.values[i])


@dataclass
class RunData:
    name: str
    run_dir: Path
    cfg: JobConfig | None
    scalars: dict[str, Series] = field(default_factory=dict)
    texts: dict[str, list[tuple[int, str]]] = field(default_factory=dict)
    info: dict = field(default_factory=dict)
    tb_dir: Path | None = None

    def tokens_at(self, steps: np.ndarray) -> np.ndarray | None:
        """Tokens seen after each of `steps` (interpolated between the logged points), or None
        when the run logged no token counts (a run from before the report hook)."""
        t = self.scalars.get(TOKENS_TAG)
        if t is None or len(t.steps) == 0:
            return None
        # Before the first logged point, tokens grow in proportion to the steps.
        xs = np.concatenate([[0], t.steps])
        ys = np.concatenate([[0], t.values])
        return np.interp(steps, xs, ys, right=None)


def tensorboard_dir(run_dir: Path, mcfg) -> Path:
    """Where the run's events are (see the module docstring), by its [metrics] section `mcfg`
    (None: a run folder without a readable config, the default tb_folder)."""
    tb_folder = mcfg.tb_folder if mcfg is not None else "tb"
    folder = run_dir.parent / tb_folder / run_dir.name
    return folder / "rank_0" if (folder / "rank_0").is_dir() else folder


def read_events(folder: Path) -> tuple[dict[str, Series], dict[str, list[tuple[int, str]]]]:
    """Every scalar series and text tag in a TensorBoard folder (purged steps dropped)."""
    if not folder.is_dir():
        return {}, {}
    entries = Store(folder).entries()
    for name, kind in sorted(entries.items()):  # the accumulator opens them by path
        if name.startswith(EVENTS) and kind != "file":
            raise Confined(f"{folder / name} is {NOT_REGULAR.get(kind, 'a folder')}")
    if not any(name.startswith(EVENTS) for name in entries):
        return {}, {}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    # A resumed run's later launch re-logs steps after its checkpoint: TensorBoard purges the
    # earlier launch's (as the viewer does) and says so on its own logger ("... likely caused by
    # a TensorFlow restart. Purging ..."), which is expected here, not news for the console.
    tb_logger = logging.getLogger("tensorboard")
    level = tb_logger.level
    tb_logger.setLevel(logging.ERROR)
    try:
        acc.Reload()
    finally:
        tb_logger.setLevel(level)
    tags = acc.Tags()
    scalars = {}
    for tag in tags.get("scalars", []):
        events = acc.Scalars(tag)
        scalars[tag] = Series(np.array([e.step for e in events], dtype=np.int64),
                              np.array([e.value for e in events], dtype=np.float64))
    texts = {}
    for tag in tags.get("tensors", []):
        events = acc.Tensors(tag)
        rows = []
        for e in events:
            values = e.tensor_proto.string_val
            if values:
                rows.append((e.step, values[0].decode("utf-8", "replace")))
        if rows:
            texts[tag.removesuffix("/text_summary")] = rows
    return scalars, texts


def load_run(run_dir: str | Path) -> RunData:
    """A run folder's config, events and report info; ValueError naming what is missing."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"run folder {run_dir} does not exist (pass job.dump_folder/<run name>, "
                         "e.g. outputs/debug_model)")
    store = Store(run_dir)
    cfg = None
    text = read_if_there(store, "config.toml")
    if text is not None:
        try:
            cfg = load_config([f"--job.config_file={run_dir / 'config.toml'}"],
                              file_runs_code=False, file_text=text)  # a run folder's: data
        except ConfigError:
            cfg = None  # written by another version: the report goes on without it
    tb_dir = tensorboard_dir(run_dir, cfg.metrics if cfg is not None else None)
    scalars, texts = read_events(tb_dir)
    text = read_if_there(store, INFO_NAME)
    try:
        info = json.loads(text) if text is not None else {}
    except ValueError as e:
        raise ValueError(f"{store.where(INFO_NAME)} is no JSON record ({e})") from None
    if not isinstance(info, dict):
        raise ValueError(f"{store.where(INFO_NAME)} holds no JSON object (the report hook "
                         "writes one)")
    if cfg is None and not scalars:
        raise ValueError(f"{run_dir} holds no config.toml and no TensorBoard events (looked in "
                         f"{tb_dir}): is it a torchllm run folder?")
    return RunData(run_dir.name, run_dir, cfg, scalars, texts, info, tb_dir)


def read_if_there(store: Store, name: str) -> str | None:
    """The text of the run folder's file `name` (None when absent), read through its Store:
    Confined (one line naming it) for a link, FIFO or folder, or a file over MAX_BYTES;
    ValueError for one that is no UTF-8 text."""
    try:
        data = store.read_bytes(name, max_bytes=MAX_BYTES)
    except FileNotFoundError:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{store.where(name)} is no UTF-8 text") from None
