"""What travels from a rank to rank 0 in a distributed run: a JSON header and raw blobs in one
byte string (:func:`encode_payload`, :func:`decode_payload`), never pickle. Used by
:mod:`hooks.dist.distributed` (re-exported there)."""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from typing import Any

_MAGIC = b"mdbP"


def _jsonable(obj: Any) -> Any:
    tolist = getattr(obj, "tolist", None)
    if callable(tolist):
        return tolist()
    return str(obj)


def encode_payload(header: Mapping[str, Any], blobs: Sequence[bytes] = ()) -> bytes:
    """``header`` (JSON; NaN and ±Infinity allowed) and ``blobs`` as one byte string:
    ``b"mdbP"``, the header's length (8 bytes, little-endian), the header, the blobs."""
    head = dict(header)
    head["blobs"] = [len(b) for b in blobs]
    text = json.dumps(head, separators=(",", ":"), default=_jsonable).encode()
    return _MAGIC + struct.pack("<Q", len(text)) + text + b"".join(blobs)


def decode_payload(data: bytes) -> tuple[dict[str, Any], list[bytes]]:
    """Inverse of :func:`encode_payload`.

    Raises:
        ValueError: Not a payload of :func:`encode_payload` (or cut short).
    """
    if data[:4] != _MAGIC or len(data) < 12:
        raise ValueError("not an mdb rank payload")
    (n,) = struct.unpack_from("<Q", data, 4)
    head = json.loads(bytes(data[12:12 + n]))
    pos, blobs = 12 + n, []
    for size in head.pop("blobs", []):
        if pos + size > len(data):
            raise ValueError("an mdb rank payload cut short")
        blobs.append(bytes(data[pos:pos + size]))
        pos += size
    return head, blobs
