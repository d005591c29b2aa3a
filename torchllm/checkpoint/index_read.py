"""A step's index read bounded: no further than the size its COMPLETE marker records, never
past INDEX_CAP, before anything in it is believed (a 3 GB sparse `.metadata` was read whole);
then decoded as data (`index.decode_index`) and each tensor's size checked against the step's
bytes (a size of 2**40 x 2**40 would be allocated by the first reader that makes it)."""

from __future__ import annotations

import math

from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from torchllm.checkpoint.index import INDEX, CorruptCheckpoint, check_reads, decode_index
from torchllm.store import Store

INDEX_CAP = 1 << 30  # bytes: an index past this is refused before it is read


def read_index(store: Store, sizes: dict[str, int]) -> Metadata:
    """The step's index, read bounded: refused (CorruptCheckpoint) before reading when COMPLETE
    records none, records more than INDEX_CAP bytes, or the file is not the size recorded;
    then decoded (`decode_index`) and each tensor's bytes checked against the step's."""
    step = store.root
    where = f"{step}/{INDEX}"
    if INDEX not in sizes:
        raise CorruptCheckpoint(f"checkpoint {step} has no readable index ({where})")
    if sizes[INDEX] > INDEX_CAP:
        raise CorruptCheckpoint(f"checkpoint index {where} is {sizes[INDEX]:,} bytes, more than "
                                f"the {INDEX_CAP:,} an index may have")
    try:
        data = store.read_bytes(INDEX, max_bytes=sizes[INDEX])
    except OSError as e:
        raise CorruptCheckpoint(f"checkpoint {step} has no readable index ({e})") from None
    if len(data) != sizes[INDEX]:
        raise CorruptCheckpoint(f"file {where} has {len(data)} bytes, {sizes[INDEX]} when saved")
    metadata = decode_index(data, where, step)
    check_reads(where, metadata, sizes)  # every read inside a file of the step
    total = sum(sizes.values())
    for fqn, meta in metadata.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            need = math.prod(meta.size) * meta.properties.dtype.itemsize
            if need > total:
                raise CorruptCheckpoint(
                    f"checkpoint index {where}: tensor {fqn!r} of size {list(meta.size)} "
                    f"({meta.properties.dtype}) needs {need:,} bytes, more than the step's "
                    f"{total:,}")
    return metadata
