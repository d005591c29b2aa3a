"""The local mirror of a checkpoint folder on object storage (`checkpoint.local_mirror`).

With a URL `checkpoint.folder`, a save can write the step to a local folder first (at disk
speed, blocking training only as long as a local save does, or only for staging when async),
then upload it in a background thread. The completeness rule is unchanged: the step's
`COMPLETE` marker is uploaded last, once every rank uploaded its files, so a kill during the
upload leaves a prefix without a marker, which resume ignores and deletes.

Each rank uploads the files it wrote (`__<rank>_*.distcp`; rank 0 also `.metadata`), so ranks
on different machines each upload from their own disk, and each computes its files' CRC-32
while reading them for the upload: the marker's checksums cost no download.
"""

from __future__ import annotations

import re
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from torchllm.storage import Location, join, storage_for

CHUNK = 16 << 20
_RANK_FILE = re.compile(r"__(0|[1-9][0-9]*)_[0-9]+\.distcp", re.ASCII)  # canonical only


def done_future(value=None) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


class Mirror:
    """Writes steps under `folder` (local) and uploads them to the remote step prefix."""

    def __init__(self, folder: Path, rank: int):
        self.folder, self.rank = Path(folder), rank
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-upload")

    def step_dir(self, step: int) -> Path:
        return self.folder / f"step-{step}"

    def mine(self, local: Path) -> list[str]:
        """The files of `local` this rank wrote (rank 0: also the metadata)."""
        names = []
        for f in sorted(local.iterdir()):
            match = _RANK_FILE.fullmatch(f.name)
            if (match and int(match.group(1)) == self.rank) or (
                    self.rank == 0 and f.name == ".metadata"):
                names.append(f.name)
        return names

    def start(self, written: Future, step: int, remote: Location) -> Future:
        """Upload this rank's files of `step` once `written` (the local save) is done; the
        future's result is {name: {"bytes", "crc32"}} of what it uploaded."""
        return self.pool.submit(self.upload, written, step, remote)

    def upload(self, written: Future, step: int, remote: Location) -> dict[str, dict]:
        written.result()  # the local write's error, if any, is this upload's
        local = self.step_dir(step)
        store = storage_for(remote)
        files = {}
        for name in self.mine(local):
            crc, size = 0, 0
            with open(local / name, "rb") as f:
                while chunk := f.read(CHUNK):
                    crc, size = zlib.crc32(chunk, crc), size + len(chunk)
            store.upload(local / name, join(remote, name))
            files[name] = {"bytes": size, "crc32": f"{crc:08x}"}
        for name in files:
            (local / name).unlink(missing_ok=True)  # uploaded: the store holds it now
        return files

    def remove(self, step: int) -> None:
        """The local step folder (what is left of it after the uploads)."""
        import shutil

        shutil.rmtree(self.step_dir(step), ignore_errors=True)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
