"""A heal's state as data: tensors as raw bytes (dtype, shape), everything else as JSON.

    MAGIC | 8-byte header length | JSON header | tensor bytes

The header is {"tree": ..., "tensors": [{"dtype", "shape", "offset", "nbytes"}, ...]}; in the
tree every value is tagged: {"d": {str: ...}} a dict of str keys, {"i": [[int, ...], ...]} one
of int keys (an optimizer's state), {"l": [...]} a list, {"t": [...]} a tuple, {"x": N} tensor
N, {"v": ...} a JSON scalar (NaN and infinities kept). Nothing is unpickled and nothing named
by the data is imported; every size is checked against the bytes received.
"""

from __future__ import annotations

import json
import math

import torch

MAGIC = b"TORCHLLM-HEAL-1\n"
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool)}


def encode(tree) -> bytes:
    """`tree` (dicts, lists, tuples, plain tensors, JSON scalars) as bytes; TypeError naming
    the path of anything else (a DTensor travels as its local tensor: HealState's)."""
    tensors: list[torch.Tensor] = []

    def walk(value, path: str):
        if isinstance(value, torch.Tensor):
            if type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter):
                raise TypeError(f"heal state {path}: a {type(value).__name__}, not a plain "
                                "tensor (send its local tensor)")
            if str(value.dtype).removeprefix("torch.") not in DTYPES:
                raise TypeError(f"heal state {path}: dtype {value.dtype} not sent")
            tensors.append(value.detach().cpu().contiguous())
            return {"x": len(tensors) - 1}
        if isinstance(value, dict):
            if all(isinstance(k, str) for k in value):
                return {"d": {k: walk(v, f"{path}.{k}") for k, v in value.items()}}
            if all(isinstance(k, int) and not isinstance(k, bool) for k in value):
                return {"i": [[k, walk(v, f"{path}.{k}")] for k, v in value.items()]}
            raise TypeError(f"heal state {path}: dict keys must be all str or all int")
        if isinstance(value, (list, tuple)):
            items = [walk(v, f"{path}[{i}]") for i, v in enumerate(value)]
            return {"l" if isinstance(value, list) else "t": items}
        if value is None or isinstance(value, (bool, int, float, str)):
            return {"v": value}
        raise TypeError(f"heal state {path}: a {type(value).__name__} is not sent (tensors, "
                        "numbers, strings, lists and dicts only)")

    tree = walk(tree, "state")
    records, offset, chunks = [], 0, []
    for t in tensors:
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        records.append({"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                        "offset": offset, "nbytes": len(raw)})
        chunks.append(raw)
        offset += len(raw)
    header = json.dumps({"tree": tree, "tensors": records}).encode()
    return b"".join([MAGIC, len(header).to_bytes(8, "big"), header, *chunks])


def decode(blob: bytes):
    """The tree encode() wrote; ValueError (one line) on anything else."""
    start = len(MAGIC) + 8
    if not blob.startswith(MAGIC) or len(blob) < start:
        raise ValueError("not a torchllm heal (no heal header)")
    size = int.from_bytes(blob[len(MAGIC):start], "big")
    if size > len(blob) - start:
        raise ValueError(f"the heal header claims {size} bytes, {len(blob) - start} came")
    try:
        header = json.loads(blob[start:start + size])
        records, tree = header["tensors"], header["tree"]
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise ValueError(f"the heal header is not its JSON record ({e})") from None
    data = memoryview(blob)[start + size:]
    tensors = [_tensor(r, data, i) for i, r in enumerate(records)] \
        if isinstance(records, list) else _bad("tensors is not a list")
    try:
        return _tree(tree, tensors)
    except RecursionError:
        raise ValueError("the heal header is nested too deeply") from None


def _bad(why: str):
    raise ValueError(f"the heal header is malformed: {why}")


def _tensor(record, data: memoryview, i: int) -> torch.Tensor:
    if not isinstance(record, dict) or record.get("dtype") not in DTYPES:
        _bad(f"tensor {i} has no allowed dtype ({', '.join(DTYPES)})")
    dtype, shape = DTYPES[record["dtype"]], record.get("shape")
    offset, nbytes = record.get("offset"), record.get("nbytes")
    if not (isinstance(shape, list) and all(type(s) is int and s >= 0 for s in shape)
            and type(offset) is int and type(nbytes) is int and offset >= 0):
        _bad(f"tensor {i}'s shape, offset or size")
    itemsize = torch.empty((), dtype=dtype).element_size()
    if nbytes != math.prod(shape) * itemsize or offset + nbytes > len(data):
        _bad(f"tensor {i}: {nbytes} bytes at {offset} for {shape} {record['dtype']} "
             f"({len(data)} bytes sent)")
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    raw = bytearray(data[offset:offset + nbytes])
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape)


def _tree(node, tensors: list):
    if not isinstance(node, dict) or len(node) != 1:
        _bad("a value is not one tagged entry")
    (tag, value), = node.items()
    if tag == "v" and (value is None or isinstance(value, (bool, int, float, str))):
        return value
    if tag == "x" and type(value) is int and 0 <= value < len(tensors):
        return tensors[value]
    if tag in ("l", "t") and isinstance(value, list):
        items = [_tree(v, tensors) for v in value]
        return items if tag == "l" else tuple(items)
    if tag == "d" and isinstance(value, dict):
        return {k: _tree(v, tensors) for k, v in value.items()}
    if tag == "i" and isinstance(value, list) and all(
            isinstance(p, list) and len(p) == 2 and type(p[0]) is int for p in value):
        return {k: _tree(v, tensors) for k, v in value}
    _bad(f"unknown or ill-formed entry {tag!r}")
