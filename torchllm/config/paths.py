"""The folders a run writes, as config keys name them, checked to stay inside the dump folder.

    <job.dump_folder>/<run name>/                       the run folder (lock, config.toml, ...)
    <job.dump_folder>/<run name>/<checkpoint.folder>/   its checkpoints
    <job.dump_folder>/<run name>/<profiling.*_folder>/  its traces and memory snapshots
    <job.dump_folder>/<metrics.tb_folder>/<run name>/   its TensorBoard events

The run name is one path component, and the other keys are relative paths strictly below the
folder they hang off: so no key can make one run's folders those of another run or the dump
folder itself, which `--job.overwrite` would then delete. The one exception: `checkpoint.folder`
may be an fsspec URL (`s3://bucket/prefix`, `gs://...`), used as is (docs/checkpointing.md,
"Object storage"); its protocol's package must be installed.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path, PurePosixPath

from torchllm.storage import Location, as_location, is_url, missing_package

NAME_ALLOWED = ("one folder name: not empty, no '/' or '\\', not '.' or '..' (leave it unset "
                "for the config file's name)")
SUBFOLDER_ALLOWED = "a relative path below {where}: not empty or '.', no '..', not absolute"


def run_name(job) -> str:
    """The run folder's name: job.run_name, else the config file's stem, else 'default'."""
    if job.run_name is not None:
        return job.run_name
    return Path(job.config_file).stem if job.config_file else "default"


def tensorboard_folder(job, metrics, run_name: str) -> Path:
    """Where a run's TensorBoard events go, from the [job] and [metrics] sections (per-rank
    subfolders under it without metrics.rank_0_only: torchllm.metrics.writers)."""
    return Path(job.dump_folder) / metrics.tb_folder / run_name


def checkpoint_folder(run_dir: Location, folder: str) -> Location:
    """`checkpoint.folder`: a URL is used as is (less a trailing '/'), a relative path lies under
    the run folder."""
    return as_location(folder) if is_url(folder) else Path(run_dir) / folder


@dataclasses.dataclass(frozen=True)
class RunFolders:
    """A run's folders (the layout above), each resolved once from its config keys."""
    run: Path  # <job.dump_folder>/<run name>
    checkpoint: Location  # checkpoint.folder below it, or its object-store URL as is
    tensorboard: Path  # <job.dump_folder>/<metrics.tb_folder>/<run name>
    tensorboard_root: Path  # <job.dump_folder>/<metrics.tb_folder>: every run's, never deleted


def run_folders(job, checkpoint, metrics) -> RunFolders:
    """The run's folders, from the [job], [checkpoint] and [metrics] sections: job.dump_folder,
    the run name, checkpoint.folder and metrics.tb_folder (each checked by `path_errors` when
    the config loads)."""
    name, dump = run_name(job), Path(job.dump_folder)
    return RunFolders(dump / name, checkpoint_folder(dump / name, checkpoint.folder),
                      tensorboard_folder(job, metrics, name), dump / metrics.tb_folder)


def bad_name(name: str) -> bool:
    return name in ("", ".", "..") or any(c in name for c in "/\\\0")


def bad_subfolder(path: str) -> bool:
    """Not a relative path strictly below its parent (absolute, '..', or nothing but '.')."""
    posix = PurePosixPath(path.replace("\\", "/"))
    return not posix.parts or posix.is_absolute() or ".." in posix.parts or "\0" in path


def local_url(url: str) -> str | None:
    """Why a checkpoint URL is refused as local files in disguise (file://, local://, or a
    '::' chain of fsspec file systems): the relative-path rule above would not apply to it, and
    it could name another run's folder. None for one object-store URL (s3://bucket/prefix)."""
    if "::" in url:
        return (f"{url!r}: a chained fsspec URL ('::') is not a checkpoint folder; give one "
                "object-store URL (s3://bucket/prefix) or a relative path below the run folder")
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    protocol = url.split("://", 1)[0]
    try:
        local = issubclass(fsspec.get_filesystem_class(protocol), LocalFileSystem)
    except (ImportError, ValueError):
        return None  # missing_package says what is missing
    if local:
        return (f"{url!r} names local files: give a relative path below the run folder "
                "(checkpoint.folder = 'checkpoint'); a URL is for object storage "
                "(s3://bucket/prefix), and another run's steps are read with "
                "checkpoint.initial_load_path")
    return None


def path_errors(job, checkpoint, profiling, metrics) -> list[tuple[str, str]]:
    """(key, message) for every folder key of these sections that would leave its parent
    folder."""
    errors = []
    sections = {"checkpoint": checkpoint, "profiling": profiling, "metrics": metrics}
    name = run_name(job)
    if bad_name(name):
        if job.run_name is not None:
            errors.append(("job.run_name",
                           f"job.run_name = {name!r}: must be {NAME_ALLOWED}"))
        else:
            errors.append(("job.run_name", f"the run name {name!r} (the stem of job.config_file "
                           f"{job.config_file!r}) is not one folder name; set "
                           "--job.run_name to one (no '/', not '.' or '..')"))
    subfolders = [("checkpoint.folder", "the run folder"),
                  ("profiling.traces_folder", "the run folder"),
                  ("profiling.memory_snapshot_folder", "the run folder"),
                  ("metrics.tb_folder", "job.dump_folder")]
    for key, where in subfolders:
        section, _, field = key.partition(".")
        value = getattr(sections[section], field)
        if key == "checkpoint.folder" and "://" in value:
            if problem := local_url(value) or missing_package(value):
                errors.append((key, f"{key} = {problem}"))
            continue
        if bad_subfolder(value):
            errors.append((key, f"{key} = {value!r}: must be "
                           + SUBFOLDER_ALLOWED.format(where=where)
                           + (" (or an fsspec URL such as s3://bucket/prefix)"
                              if key == "checkpoint.folder" else "")))
    mirror = checkpoint.local_mirror
    if mirror and "://" not in checkpoint.folder:
        errors.append(("checkpoint.local_mirror", f"checkpoint.local_mirror = {mirror!r} mirrors "
                       "a checkpoint folder on object storage, but checkpoint.folder = "
                       f"{checkpoint.folder!r} is local; set checkpoint.folder to a URL "
                       "(s3://bucket/prefix) or leave local_mirror unset"))
    elif mirror and bad_subfolder(mirror):
        errors.append(("checkpoint.local_mirror", f"checkpoint.local_mirror = {mirror!r}: must "
                       "be " + SUBFOLDER_ALLOWED.format(where="the run folder")))
    tb_top = PurePosixPath(metrics.tb_folder.replace("\\", "/")).parts[:1]
    if not errors and tb_top == (name,):
        errors.append(("job.run_name", f"job.run_name = {name!r} is the first folder of "
                       f"metrics.tb_folder ({metrics.tb_folder!r}), where every run's "
                       "TensorBoard events go; choose another run name"))
    return errors
