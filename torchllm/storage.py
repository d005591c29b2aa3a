"""Where files live: a local folder or an object store (s3://, gs://, any fsspec URL). A leaf:
it imports nothing from torchllm, and knows nothing of what the files mean (checkpoints, shards).

Every file operation goes through `storage_for(location)`, resolved once per protocol (the
package check and the client are cached): a `LocalStorage` for a path, an `FsspecStorage` for a
URL, both over one fsspec file system (`.fs`), offering the same few operations (list a folder's
subfolders in one listing, read, write durably, delete a folder, move one, sizes and contents,
ranged reads), so no caller branches on the kind of location.

A location is a `Path` (local) or a `str` URL (`s3://bucket/prefix/step-4`); `join` appends
names to either. What object stores change, and how each operation copes:
- no atomic rename: `write_durably` is one PUT (an object appears whole or not at all);
- no directories: a folder is the prefix `<folder>/` (with the slash: deleting step-1 never
  touches step-10); `move` and `remove_tree` can delete a named file (a commit marker) first;
- listing is slow: `scan` lists a folder's objects once (callers keep its result);
- credentials and endpoints come from the store's own environment (AWS_ENDPOINT_URL,
  AWS_ACCESS_KEY_ID, ... for S3); nothing secret is in a config or a log line;
- a store that stalls or refuses: an S3 request attempt fails once it went unanswered for
  `checkpoint.store_timeout_s` (`set_store_timeout`; s3fs tries 5 times), instead of blocking
  for many minutes (botocore's retries inside s3fs's multiply otherwise).
"""

from __future__ import annotations

import os
import shutil
import zlib
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
        _storage_of.cache_clear()


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


def shown(location: Location) -> str:
    """A location as a message names it: a URL or absolute path as given, a relative path with
    what it resolved to (`my_texts/ (= /home/me/work/my_texts, from the current directory)`),
    so a "not found" says where it looked."""
    if is_url(location) or Path(location).is_absolute():
        return str(location)
    return f"{location} (= {Path(location).absolute()}, from the current directory)"


def missing_package(url: str) -> str | None:
    """One line naming the package to install when `url`'s protocol is not importable."""
    problem = _missing(url.split("://", 1)[0])
    return f"{url}: {problem}" if problem else None


@lru_cache(maxsize=None)
def _missing(protocol: str) -> str | None:
    """What `missing_package` says about a protocol (looked up once per protocol)."""
    import fsspec

    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError:
        needs = PACKAGES.get(protocol, (None, f"the fsspec implementation of {protocol}://"))[1]
        return f"{protocol}:// needs {needs}"
    except ValueError:
        return f"unknown protocol {protocol}:// (fsspec knows none by that name)"
    package = PACKAGES.get(protocol, (None,))[0]
    if package == "s3fs":  # 0.x releases (2019-20) predate the async API the DCP writer uses
        from importlib.metadata import version

        found = version("s3fs")
        if int(found.split(".")[0]) < MIN_S3FS:
            return (f"s3fs {found} is too old; needs s3fs >= {MIN_S3FS} "
                    '(pip install -U "s3fs>=2024.6")')
    return None


class FsspecStorage:
    """Files under one fsspec file system: an object store (or any fsspec URL) under one
    protocol; `LocalStorage` is the same over the local file system.

    Listings are never served from fsspec's cache (other processes write the same prefixes);
    callers keep what `scan` found instead."""

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
        """{subfolder name: names of the files directly inside it} for every subfolder, from
        one listing."""
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

    def move(self, src: Location, dst: Location, first: str | None = None) -> None:
        """Copy every object, then delete the source (the file named `first` before the rest:
        a commit marker, so a source cut short never looks complete)."""
        src_key, dst_key = self._key(src), self._key(dst)
        for key in self._objects(src):
            self.fs.copy(key, dst_key + key[len(src_key):])
        if first is not None:
            self.remove_file(join(src, first))
        self.remove_tree(src)

    def local_copy(self, location: Location) -> Path:
        """A local path holding `location`'s content (the file itself when it is local)."""
        import tempfile

        path = Path(tempfile.mkdtemp(prefix="torchllm-")) / name_of(location)
        path.write_bytes(self.read_bytes(location))
        return path

    def upload(self, local: Path, location: Location) -> None:
        """Copy the local file `local` to `location`."""
        self.fs.put_file(str(local), self._key(location))

    def files(self, folder: Location) -> dict[str, int]:
        """{name: size} of the files directly in `folder`."""
        root = self._key(folder) + "/"
        return {info["name"][len(root):]: int(info["size"])
                for info in self.fs.find(root, detail=True).values()
                if "/" not in info["name"][len(root):]}

    def open(self, location: Location) -> IO[bytes]:
        return self.fs.open(self._key(location), "rb")

    def crc32(self, location: Location, chunk: int = 16 << 20) -> str:
        """CRC-32 of a file or object, read in 16 MiB chunks (zlib releases the GIL)."""
        crc = 0
        with self.open(location) as f:
            for block in iter_chunks(f, chunk):
                crc = zlib.crc32(block, crc)
        return f"{crc:08x}"

    def read_folder(self, folder: Location, names: tuple[str, ...]
                    ) -> tuple[dict[str, int], dict[str, bytes | OSError]]:
        """({name: size} of the files in `folder`, {name: its bytes, or the OSError reading
        it} for each of `names` present): a small folder's files, read in one go."""
        sizes = self.files(folder)
        read: dict[str, bytes | OSError] = {}
        for name in names:
            if name in sizes:
                try:
                    read[name] = self.read_bytes(join(folder, name))
                except OSError as e:
                    read[name] = e
        return sizes, read

    def read_range(self, location: Location, start: int, end: int) -> bytes:
        """Bytes [start, end) of a file (one ranged GET on an object store)."""
        return self.fs.cat_file(self._key(location), start=start, end=end)

    def free_bytes(self, folder: Location) -> int | None:
        """Free bytes on the disk holding `folder`; None: an object store does not fill up."""
        return None


class LocalStorage(FsspecStorage):
    """A folder on a local (or mounted) file system: fsspec's local file system, with what a
    disk does better than an object store (a durable rename, real folders, free space)."""

    remote = False

    def __init__(self):
        super().__init__("file")

    def scan(self, folder: Location) -> dict[str, set[str]]:
        folder = Path(folder)
        if not folder.is_dir():
            return {}
        return {c.name: {f.name for f in c.iterdir() if f.is_file()}
                for c in folder.iterdir() if c.is_dir()}

    def is_dir(self, location: Location) -> bool:
        return Path(location).is_dir()

    def write_durably(self, location: Location, text: str) -> None:
        """A temp file, fsync'd, renamed over `location`, then the folder fsync'd: after a crash
        `location` holds its old content or all of `text`, never an empty or partial file. The
        temp file is created new (`create_new`): a link planted at its name is never followed."""
        path = Path(location)
        tmp = path.parent / f".{path.name}.tmp"
        with os.fdopen(create_new(tmp), "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)  # replaces a link at `path` itself, never what it points to
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)  # the rename itself
        finally:
            os.close(fd)

    def remove_tree(self, location: Location) -> None:
        if Path(location).exists():
            shutil.rmtree(location)

    def move(self, src: Location, dst: Location, first: str | None = None) -> None:
        """One rename (atomic: `first` needs no deleting ahead of the rest)."""
        Path(dst).parent.mkdir(parents=True, exist_ok=True)
        Path(src).rename(dst)

    def local_copy(self, location: Location) -> Path:
        return Path(location)

    def upload(self, local: Path, location: Location) -> None:
        Path(location).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(local, location)

    def files(self, folder: Location) -> dict[str, int]:
        return {f.name: f.stat().st_size for f in Path(folder).iterdir() if f.is_file()}

    def read_range(self, location: Location, start: int, end: int) -> bytes:
        with open(location, "rb") as f:
            f.seek(start)
            return f.read(end - start)

    def free_bytes(self, folder: Location) -> int | None:
        """Free bytes on the disk holding `folder` (or its nearest existing parent)."""
        folder = Path(folder).absolute()
        while not folder.exists():
            folder = folder.parent
        return shutil.disk_usage(folder).free


def create_new(path: Path) -> int:
    """A write descriptor of a file created new at `path` (O_EXCL | O_NOFOLLOW: whatever is at
    that name, a link included, is never written through). An entry already there (a temp file
    left by a crash, or a planted link) is unlinked first: the entry itself, not its target."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    try:
        return os.open(path, flags, 0o644)
    except FileExistsError:
        os.unlink(path)
        return os.open(path, flags, 0o644)


LOCAL = ""  # _storage_of's key for local paths (a file:// URL is an fsspec location like s3://)


@lru_cache(maxsize=None)
def _storage_of(protocol: str) -> FsspecStorage:
    """The storage of a protocol, made once (again after `set_store_timeout` changes it)."""
    if protocol == LOCAL:
        return LocalStorage()
    problem = _missing(protocol)
    if problem:
        raise ImportError(problem)
    return FsspecStorage(protocol, STORE_TIMEOUT_S)


def storage_for(location: Location) -> FsspecStorage:
    """The storage that holds `location`; a missing fsspec implementation (s3fs, gcsfs) is one
    ImportError line naming the URL and what to install."""
    if not is_url(location):
        return _storage_of(LOCAL)
    try:
        return _storage_of(location.split("://", 1)[0])
    except ImportError as e:
        raise ImportError(f"{location}: {e}") from None


def iter_chunks(stream: IO[bytes], size: int) -> Iterator[bytes]:
    while chunk := stream.read(size):
        yield chunk
