"""A location opened ONCE as (file system, root): the one confined place through which torchllm
reads and writes a folder it did not create itself (run folders, checkpoint steps, HF folders,
reports, eval data). A leaf over `storage` (it knows nothing of what the files mean).

What the store guarantees, whatever the folder holds or its files say:
- names are plain: every name given to it (also one taken from a file's content: an index's
  shard name, a step folder's name) is split on `/` and each part must be a non-empty name that
  is not `.` or `..`, holds no `\\` or NUL, and is not absolute; else `Confined`;
- nothing resolves outside the root: on a local disk every part below the root is opened with
  `O_NOFOLLOW` relative to its parent's descriptor, so a symbolic link anywhere below the root is
  refused (`Confined`, naming the link), never followed; a FIFO, socket or device is refused
  before it is opened for reading (a read never blocks on a FIFO);
- reads are bounded: `read_bytes(name, max_bytes=N)` checks the size before it reads;
- writes never follow a link or replace what they did not create: a new temporary file is
  created exclusively (`O_CREAT | O_EXCL | O_NOFOLLOW`) beside the target, written, fsync'd and
  renamed over the target (rename replaces a link itself, never what it points to), then the
  folder is fsync'd;
- deleting removes only the entry named (a link is unlinked, never its target).

The root itself is the user's own choice (a path on their command line or in their config) and
may be reached through links; object stores (`s3://...`) have no links, and the same names are
checked there.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import zlib
from pathlib import Path

from torchllm.storage import FsspecStorage, Location, as_location, is_url, join, storage_for


class Confined(OSError):
    """A name or entry the store refuses: outside the root, a link, not a regular file, or
    larger than allowed. Its message is one line naming the path and what was found."""


def plain_parts(name: str, where: Location | None = None) -> list[str]:
    """The parts of a relative `name` (`a/b.txt` -> ['a', 'b.txt']); Confined unless each is a
    plain name."""
    shown = f"{where}/{name}" if where is not None else name
    if not isinstance(name, str) or not name or name.startswith("/") or "\x00" in name \
            or "\\" in name:
        raise Confined(f"{shown!r} is not a plain relative name")
    parts = name.split("/")
    for part in parts:
        if part in ("", ".", ".."):
            raise Confined(f"{shown!r} leads outside its folder ({part or 'empty'!r} part)")
    return parts


def _kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "folder"
    if stat.S_ISLNK(mode):
        return "link"
    if stat.S_ISFIFO(mode):
        return "fifo"
    if stat.S_ISSOCK(mode):
        return "socket"
    return "device"


NOT_REGULAR = {"link": "a symbolic link (links are not followed)", "fifo": "a FIFO, not a regular file",
               "socket": "a socket, not a regular file", "device": "a device, not a regular file"}


class Store:
    """Files under one root (a local folder or a URL), opened once. Every name is relative to
    the root and checked by `plain_parts`; see the module docstring for what is guaranteed."""

    def __init__(self, root: Location, storage: FsspecStorage | None = None):
        self.root = as_location(root)
        self.storage = storage or storage_for(self.root)
        self.remote = is_url(self.root)

    def __repr__(self) -> str:
        return f"Store({self.root})"

    def where(self, name: str = "") -> Location:
        """The location of `name` under the root (checked: never outside it)."""
        return join(self.root, *plain_parts(name, self.root)) if name else self.root

    def child(self, name: str) -> Store:
        """The store of a subfolder (`name` checked, and on a local disk not a link)."""
        if not self.remote and self.kind(name) == "link":
            raise Confined(f"{self.where(name)} is {NOT_REGULAR['link']}")
        return Store(self.where(name), self.storage)

    # ------------------------------------------------------------------ local descriptors

    def _open_parent(self, parts: list[str], create: bool = False) -> int:
        """A descriptor of the folder holding `parts[-1]`, every part below the root opened with
        O_NOFOLLOW (a link is refused, naming it); the caller closes it."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for i, part in enumerate(parts[:-1]):
                if create:
                    try:
                        os.mkdir(part, dir_fd=fd)
                    except FileExistsError:
                        pass
                try:
                    nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                except OSError as e:
                    raise self._refusal(e, parts[:i + 1], fd, part) from None
                os.close(fd)
                fd = nxt
            return fd
        except BaseException:
            os.close(fd)
            raise

    def _refusal(self, error: OSError, parts: list[str], fd: int, part: str) -> OSError:
        """The error for opening `part` in `fd`: Confined for a link or a non-folder, else the
        OSError itself, named by its full path."""
        where = join(self.root, *parts)
        try:
            kind = _kind(os.lstat(part, dir_fd=fd).st_mode)
        except OSError:
            kind = None
        if kind in NOT_REGULAR:
            return Confined(f"{where} is {NOT_REGULAR[kind]}")
        if error.errno in (errno.ELOOP, errno.ENOTDIR) or kind == "file":
            return Confined(f"{where} is not a folder")
        return type(error)(error.errno, error.strerror, str(where))

    # ------------------------------------------------------------------ reading

    def kind(self, name: str) -> str | None:
        """'file', 'folder', 'link', 'fifo', 'socket', 'device', or None when absent."""
        parts = plain_parts(name, self.root)
        if self.remote:
            where = self.where(name)
            return "file" if self.storage.is_file(where) else \
                "folder" if self.storage.is_dir(where) else None
        try:
            fd = self._open_parent(parts)
        except FileNotFoundError:
            return None
        try:
            return _kind(os.lstat(parts[-1], dir_fd=fd).st_mode)
        except FileNotFoundError:
            return None
        finally:
            os.close(fd)

    def entries(self, name: str = "") -> dict[str, str]:
        """{entry name: kind} of what is directly in the root (or its subfolder `name`), links
        not followed. An absent folder has no entries."""
        parts = plain_parts(name, self.root) if name else []
        if not self.remote:
            try:
                fd = self._open_parent([*parts, "."])
            except FileNotFoundError:
                return {}
            try:
                return {e.name: _kind(e.stat(follow_symlinks=False).st_mode)
                        for e in os.scandir(fd)}
            finally:
                os.close(fd)
        folder = self.where(name)
        out = {sub: "folder" for sub in self.storage.scan(folder)}
        out.update({f: "file" for f in self.storage.files(folder)} if
                   self.storage.is_dir(folder) else {})
        return out

    def files(self, name: str = "") -> dict[str, int]:
        """{name: size} of the regular files directly in the root (or subfolder `name`); links,
        FIFOs and the like are left out (`entries` shows them)."""
        if self.remote:
            return self.storage.files(self.where(name))
        out = {}
        for entry, kind in self.entries(name).items():
            if kind == "file":
                out[entry] = self.size(f"{name}/{entry}" if name else entry)
        return out

    def _open_file(self, name: str) -> int:
        """A read descriptor of the regular file `name` (Confined for anything else)."""
        parts = plain_parts(name, self.root)
        fd = self._open_parent(parts)
        try:
            try:
                mode = os.lstat(parts[-1], dir_fd=fd).st_mode
            except FileNotFoundError:
                raise FileNotFoundError(errno.ENOENT, "no such file", str(self.where(name))) \
                    from None
            if not stat.S_ISREG(mode):
                raise Confined(f"{self.where(name)} is "
                               f"{NOT_REGULAR.get(_kind(mode), 'a folder, not a file')}")
            return os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
        finally:
            os.close(fd)

    def size(self, name: str) -> int:
        if self.remote:
            return int(self.storage.fs.size(self.storage._key(self.where(name))))
        fd = self._open_file(name)
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    def read_bytes(self, name: str, max_bytes: int | None = None) -> bytes:
        """The whole file, refused (Confined, naming both sizes) before it is read when it is
        larger than `max_bytes`."""
        if self.remote:
            where = self.where(name)
            if max_bytes is not None:
                self._check_size(where, self.size(name), max_bytes)
            return self.storage.read_bytes(where)
        fd = self._open_file(name)
        try:
            if max_bytes is not None:
                self._check_size(self.where(name), os.fstat(fd).st_size, max_bytes)
            with os.fdopen(fd, "rb", closefd=False) as f:
                data = f.read() if max_bytes is None else f.read(max_bytes + 1)
            if max_bytes is not None:  # it grew after the size check
                self._check_size(self.where(name), len(data), max_bytes)
            return data
        finally:
            os.close(fd)

    @staticmethod
    def _check_size(where: Location, size: int, max_bytes: int) -> None:
        if size > max_bytes:
            raise Confined(f"{where} is {size:,} bytes, more than the {max_bytes:,} allowed")

    def read_text(self, name: str, max_bytes: int | None = None) -> str:
        return self.read_bytes(name, max_bytes).decode("utf-8")

    def crc32(self, name: str, chunk: int = 16 << 20) -> str:
        """CRC-32 of the regular file `name`, read in 16 MiB chunks (zlib releases the GIL
        while hashing); a link is refused, never followed."""
        crc = 0
        with self.open(name) as f:
            while block := f.read(chunk):
                crc = zlib.crc32(block, crc)
        return f"{crc:08x}"

    def open(self, name: str):
        """A binary read stream of the regular file `name`."""
        if self.remote:
            return self.storage.open(self.where(name))
        return os.fdopen(self._open_file(name), "rb")

    # ------------------------------------------------------------------ writing

    def write_bytes(self, name: str, data: bytes) -> Location:
        """Replace `name` with `data` durably: a new temporary file created exclusively without
        following links, fsync'd, renamed over `name` (which, if a link, is replaced itself),
        then the folder fsync'd. Missing folders below the root are made (never through links)."""
        where = self.where(name)
        if self.remote:
            self.storage.fs.pipe_file(self.storage._key(where), data)
            return where
        parts = plain_parts(name, self.root)
        Path(self.root).mkdir(parents=True, exist_ok=True)
        fd = self._open_parent(parts, create=True)
        try:
            tmp = f".{parts[-1]}.{os.getpid()}.tmp"
            out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644,
                          dir_fd=fd)
            try:
                with os.fdopen(out, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, parts[-1], src_dir_fd=fd, dst_dir_fd=fd)
            except BaseException:
                try:
                    os.unlink(tmp, dir_fd=fd)
                except OSError:
                    pass
                raise
            os.fsync(fd)
        finally:
            os.close(fd)
        return where

    def write_text(self, name: str, text: str) -> Location:
        return self.write_bytes(name, text.encode("utf-8"))

    def remove(self, name: str) -> None:
        """Delete the entry `name` only: a file or link is unlinked, a folder removed with what
        is in it (shutil.rmtree never follows links inside it); absent is fine."""
        if self.remote:
            where = self.where(name)
            self.storage.remove_file(where)
            self.storage.remove_tree(where)
            return
        parts = plain_parts(name, self.root)
        try:
            fd = self._open_parent(parts)
        except FileNotFoundError:
            return
        try:
            try:
                mode = os.lstat(parts[-1], dir_fd=fd).st_mode
            except FileNotFoundError:
                return
            if stat.S_ISDIR(mode):
                shutil.rmtree(parts[-1], dir_fd=fd)
            else:
                os.unlink(parts[-1], dir_fd=fd)
        finally:
            os.close(fd)


def open_store(root: Location) -> Store:
    """The store of `root` (a local folder or a URL)."""
    return Store(root)


def as_store(place: Location | Store) -> Store:
    """`place` as a Store: a Store as it is (its file system is not resolved again), a local
    path or URL opened."""
    return place if isinstance(place, Store) else Store(place)
