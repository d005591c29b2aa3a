"""Where checkpoints live: a local folder or an object store (s3://, gs://, any fsspec URL).

Every file operation the checkpoint code does goes through `storage_for(location)`: a
`LocalStorage` for a path, an `FsspecStorage` for a URL. Both offer the same few operations
(list a folder's steps in one listing, read, write a marker durably, delete a step, sizes and
contents for checksums, DCP's writer and reader), so no caller branches on the kind of location.

A location is a `Path` (local) or a `str` URL (`s3://bucket/prefix/step-4`); `join` appends
names to either. What object stores change, and how each operation copes:
- no atomic rename: a marker is one PUT (an object appears whole or not at all), and a step is
  complete only once its marker exists, written after every other object of the step;
- no directories: a step is the prefix `<folder>/step-<N>/` (with the slash: deleting step-1
  never touches step-10), and deleting it deletes the marker first;
- listing is slow: `scan` lists a folder's objects once and the Checkpointer keeps its result;
- credentials and endpoints come from the store's own environment (AWS_ENDPOINT_URL,
  AWS_ACCESS_KEY_ID, ... for S3); nothing secret is in a config or a log line;
- a store that stalls or refuses: an S3 request attempt fails once it went unanswered for
  `checkpoint.store_timeout_s` (`set_store_timeout`; s3fs tries 5 times), instead of blocking
  for many minutes (botocore's retries inside s3fs's multiply otherwise).
"""

from __future__ import annotations

import os
import shutil
from functools import lru_cache
from pathlib import Path
from typing import IO, Iterator

Location = Path | str

# fsspec protocol -> the package that implements it, for the one-line error when it is missing.
PACKAGES = {"s3": ("s3fs", 's3fs (pip install -e ".[s3]")'),
            "s3a": ("s3fs", 's3fs (pip install -e ".[s3]")'),
            "gs": ("gcsfs", "gcsfs (pip install gcsfs)"),
            "gcs": ("gcsfs", "gcsfs (pip install gcsfs)"),
            "az": ("adlfs", "adlfs (pip install adlfs)"),
            "abfs": ("adlfs", "adlfs (pip install adlfs)")}
MIN_S3FS = 2024  # calendar-versioned releases; pyproject's extras ask for >= 2024.6
STORE_TIMEOUT_S = 60.0  # checkpoint.store_timeout_s's default


def client_options(protocol: str, timeout_s: float) -> dict:
    """fsspec options for a client whose every request attempt fails once it waited `timeout_s`
    seconds to connect or for an answer (S3; other stores keep their clients' own timeouts).
    botocore makes one attempt: s3fs already retries a timed-out request (5 tries, ~2 s of
    backoff), so a store that never answers fails an operation after ~5 x timeout_s, not the
    many minutes botocore's retries inside s3fs's would take."""
    if protocol not in ("s3", "s3a"):
        return {}
    return {"config_kwargs": {"connect_timeout": timeout_s, "read_timeout": timeout_s,
                              "retries": {"total_max_attempts": 1}}}


def set_store_timeout(seconds: float) -> None:
    """Bound every later object-store request (the clients are made again when it changes)."""
    global STORE_TIMEOUT_S
    if seconds != STORE_TIMEOUT_S:
        STORE_TIMEOUT_S = float(seconds)
        _fsspec_storage.cache_clear()


def is_url(location: Location | None) -> bool:
    """An fsspec URL (`scheme://...`), as opposed to a local path."""
    return isinstance(location, str) and "://" in location


def as_location(location: Location) -> Location:
    """A URL stays a string (without a trailing '/'); anything else becomes a Path."""
    return location.rstrip("/") if is_url(location) else Path(location)


def join(location: Location, *names: str) -> Location:
    if is_url(location):
        return "/".join([location.rstrip("/"), *names])
    return Path(location).joinpath(*names)


def name_of(location: Location) -> str:
    return location.rstrip("/").rsplit("/", 1)[-1] if is_url(location) else Path(location).name


def parent_of(location: Location) -> Location:
    return location.rstrip("/").rsplit("/", 1)[0] if is_url(location) else Path(location).parent


def checkpoint_folder(run_dir: Location, folder: str) -> Location:
    """`checkpoint.folder`: a URL is used as is, a relative path lies under the run folder."""
    return as_location(folder) if is_url(folder) else Path(run_dir) / folder


def missing_package(url: str) -> str | None:
    """One line naming the package to install when `url`'s protocol is not importable."""
    import fsspec

    protocol = url.split("://", 1)[0]
    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError:
        needs = PACKAGES.get(protocol, (None, f"the fsspec implementation of {protocol}://"))[1]
        return f"{url}: {protocol}:// needs {needs}"
    except ValueError:
        return f"{url}: unknown protocol {protocol}:// (fsspec knows none by that name)"
    package = PACKAGES.get(protocol, (None,))[0]
    if package == "s3fs":  # 0.x releases (2019-20) predate the async API the DCP writer uses
        from importlib.metadata import version

        found = version("s3fs")
        if int(found.split(".")[0]) < MIN_S3FS:
            return (f"{url}: s3fs {found} is too old; needs s3fs >= {MIN_S3FS} "
                    '(pip install -U "s3fs>=2024.6")')
    return None


class LocalStorage:
    """A folder on a local (or mounted) file system."""

    remote = False

    def scan(self, folder: Location) -> dict[str, set[str]]:
        """{subfolder name: names of the files directly inside it} for every subfolder."""
        folder = Path(folder)
        if not folder.is_dir():
            return {}
        return {c.name: {f.name for f in c.iterdir() if f.is_file()}
                for c in folder.iterdir() if c.is_dir()}

    def is_file(self, location: Location) -> bool:
        return Path(location).is_file()

    def is_dir(self, location: Location) -> bool:
        return Path(location).is_dir()

    def read_bytes(self, location: Location) -> bytes:
        return Path(location).read_bytes()

    def write_durably(self, location: Location, text: str) -> None:
        """A temp file, fsync'd, renamed over `location`, then the folder fsync'd: after a crash
        `location` holds its old content or all of `text`, never an empty or partial file."""
        path = Path(location)
        tmp = path.parent / f".{path.name}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)  # the rename itself
        finally:
            os.close(fd)

    def remove_file(self, location: Location) -> None:
        Path(location).unlink(missing_ok=True)

    def remove_tree(self, location: Location) -> None:
        if Path(location).exists():
            shutil.rmtree(location)

    def move(self, src: Location, dst: Location) -> None:
        Path(dst).parent.mkdir(parents=True, exist_ok=True)
        Path(src).rename(dst)

    def local_copy(self, location: Location) -> Path:
        """A local path holding `location`'s content (the file itself when it is local)."""
        return Path(location)

    def upload(self, local: Path, location: Location) -> None:
        """Copy the local file `local` to `location`."""
        Path(location).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(local, location)

    def files(self, folder: Location) -> dict[str, int]:
        """{name: size} of the files directly in `folder`."""
        return {f.name: f.stat().st_size for f in Path(folder).iterdir() if f.is_file()}

    def open(self, location: Location) -> IO[bytes]:
        return open(location, "rb")

    def read_range(self, location: Location, start: int, end: int) -> bytes:
        """Bytes [start, end) of a file (one ranged GET on an object store)."""
        with open(location, "rb") as f:
            f.seek(start)
            return f.read(end - start)

    def free_bytes(self, folder: Location) -> int | None:
        """Free bytes on the disk holding `folder` (or its nearest existing parent)."""
        folder = Path(folder).absolute()
        while not folder.exists():
            folder = folder.parent
        return shutil.disk_usage(folder).free

    def writer(self, location: Location):
        from torch.distributed.checkpoint import FileSystemWriter

        return FileSystemWriter(str(location))

    def reader(self, location: Location):
        """DCP's reader, whose pickles are data only (safe_load: allow-listed types)."""
        from torchllm.checkpoint.safe_load import SafeFileSystemReader

        return SafeFileSystemReader(str(location))


class FsspecStorage(LocalStorage):
    """An object store (or any fsspec file system) under one protocol.

    Listings are never served from fsspec's cache (other processes write the same prefixes);
    the Checkpointer keeps its own list of steps instead."""

    remote = True
    OPTIONS = {"use_listings_cache": False}

    def __init__(self, protocol: str, timeout_s: float = STORE_TIMEOUT_S):
        import fsspec

        self.protocol = protocol
        self.timeout_s = timeout_s
        self.options = {**self.OPTIONS, **client_options(protocol, timeout_s)}
        self.fs = fsspec.filesystem(protocol, **self.options)

    def _key(self, location: Location) -> str:
        return self.fs._strip_protocol(str(location)).rstrip("/")

    def scan(self, folder: Location) -> dict[str, set[str]]:
        root = self._key(folder) + "/"
        out: dict[str, set[str]] = {}
        try:
            found = self.fs.find(root)
        except FileNotFoundError:
            return {}
        for key in found:
            parts = key[len(root):].split("/") if key.startswith(root) else []
            if len(parts) >= 2:
                names = out.setdefault(parts[0], set())
                if len(parts) == 2:
                    names.add(parts[1])
        return out

    def is_file(self, location: Location) -> bool:
        return self.fs.isfile(self._key(location))

    def is_dir(self, location: Location) -> bool:
        return bool(self._objects(location))

    def read_bytes(self, location: Location) -> bytes:
        return self.fs.cat_file(self._key(location))

    def write_durably(self, location: Location, text: str) -> None:
        """One PUT: an object store shows the whole object or none of it."""
        self.fs.pipe_file(self._key(location), text.encode())

    def remove_file(self, location: Location) -> None:
        try:
            self.fs.rm_file(self._key(location))
        except FileNotFoundError:
            pass

    def _objects(self, folder: Location) -> list[str]:
        """Every object under the prefix `folder/` (the slash: step-1 is not step-10)."""
        try:
            return self.fs.find(self._key(folder) + "/")
        except FileNotFoundError:
            return []

    def remove_tree(self, location: Location) -> None:
        objects = self._objects(location)
        if objects:
            self.fs.rm(objects)

    def move(self, src: Location, dst: Location) -> None:
        """Copy every object, then delete the source (its marker first)."""
        src_key, dst_key = self._key(src), self._key(dst)
        objects = self._objects(src)
        for key in objects:
            self.fs.copy(key, dst_key + key[len(src_key):])
        from torchllm.checkpoint.layout import MARKER

        self.remove_file(join(src, MARKER))
        self.remove_tree(src)

    def local_copy(self, location: Location) -> Path:
        import tempfile

        path = Path(tempfile.mkdtemp(prefix="torchllm-")) / name_of(location)
        path.write_bytes(self.read_bytes(location))
        return path

    def upload(self, local: Path, location: Location) -> None:
        self.fs.put_file(str(local), self._key(location))

    def files(self, folder: Location) -> dict[str, int]:
        root = self._key(folder) + "/"
        return {info["name"][len(root):]: int(info["size"])
                for info in self.fs.find(root, detail=True).values()
                if "/" not in info["name"][len(root):]}

    def open(self, location: Location) -> IO[bytes]:
        return self.fs.open(self._key(location), "rb")

    def read_range(self, location: Location, start: int, end: int) -> bytes:
        return self.fs.cat_file(self._key(location), start=start, end=end)

    def free_bytes(self, folder: Location) -> int | None:
        return None  # an object store does not fill up like a disk

    def writer(self, location: Location):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        # No fsync: it means nothing for an upload (and falls back to a machine-wide sync()).
        return FsspecWriter(str(location), sync_files=False, **self.options)

    def reader(self, location: Location):
        from torchllm.checkpoint.safe_load import safe_fsspec_reader

        return safe_fsspec_reader(str(location), **self.options)


_LOCAL = LocalStorage()


@lru_cache(maxsize=None)
def _fsspec_storage(protocol: str) -> FsspecStorage:
    return FsspecStorage(protocol, STORE_TIMEOUT_S)


def storage_for(location: Location) -> LocalStorage:
    """The storage that holds `location`; a missing fsspec implementation (s3fs, gcsfs) is one
    ImportError line naming what to install."""
    if not is_url(location):
        return _LOCAL
    problem = missing_package(location)
    if problem:
        raise ImportError(problem)
    return _fsspec_storage(location.split("://", 1)[0])


def iter_chunks(stream: IO[bytes], size: int) -> Iterator[bytes]:
    while chunk := stream.read(size):
        yield chunk
