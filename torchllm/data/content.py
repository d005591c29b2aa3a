"""What a data source's content is, as one string a checkpoint records (`Source.content_identity`).

Files (local: and chat: files, shards, the shipped corpora) are identified by a full streamed
BLAKE2b of their bytes, and names, never by samples: a one-byte, same-length edit of a text
corpus changes it. A file's digest is kept for this process, keyed by its path, size, inode and
modification/change times, so a mixture naming one file twice or a second Trainer in one process
reads it once. A stream read by name (a Hugging Face dataset) is identified by that name, subset
and split.

Every identity starts with its scheme ("files:blake2b:...", "hf:..."): a checkpoint written
before identities (a 16-hex sample digest) is told apart and not compared
(torchllm.data.fingerprint.changes).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from torchllm.storage import Location, is_url, name_of, storage_for

CHUNK = 1 << 20  # bytes read at a time: a shard is never held in memory whole
_DIGESTS: dict[tuple, str] = {}  # (path, size, inode, mtime_ns, ctime_ns) -> hex digest


def _file_digest(path: Location) -> str:
    """The BLAKE2b of one file's bytes (streamed; a local file's is cached by its stat)."""
    key = None
    if not is_url(path):
        st = os.stat(path)
        key = (str(Path(path).resolve()), st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)
        if key in _DIGESTS:
            return _DIGESTS[key]
    h = hashlib.blake2b(digest_size=20)
    with storage_for(path).open(path) as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    digest = h.hexdigest()
    if key is not None:
        _DIGESTS[key] = digest
    return digest


def files_identity(paths: list[Location]) -> str:
    """'files:blake2b:HEX' over every file's name and full content, in the given order."""
    h = hashlib.blake2b(digest_size=20)
    for path in paths:
        h.update(f"{name_of(path)}\0{_file_digest(path)}\n".encode())
    return "files:blake2b:" + h.hexdigest()


def texts_identity(texts) -> str:
    """'texts:blake2b:HEX' over documents held in memory (the corpora shipped with Python)."""
    h = hashlib.blake2b(digest_size=20)
    for text in texts:
        data = text.encode()
        h.update(f"{len(data)}\0".encode() + data)
    return "texts:blake2b:" + h.hexdigest()
