"""Crafting session logs for tests: unpack a log into its objects, change them, pack them again
with valid checksums (as an adversary who read `sim/session/log.py` would)."""

from __future__ import annotations

import zlib

import msgpack


def unpack_log(data: bytes) -> list:
    """Every msgpack object of a log, in order: header, events, checkpoints, footer, end mark."""
    up = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=len(data) + 16)
    up.feed(data)
    return list(up)


def pack_log(objs: list) -> bytes:
    """The objects packed again, each checkpoint (a map with "crc") given the CRC of the bytes
    since the previous one and the count of event records (lists) before it."""
    pk = msgpack.Packer(use_bin_type=True)
    out, chunk, n = [], b"", 0
    for o in objs:
        if isinstance(o, dict) and "crc" in o:
            o = dict(o, crc=zlib.crc32(chunk), n=n)
            out.append(chunk + pk.pack(o))
            chunk = b""
            continue
        if isinstance(o, list):
            n += 1
        chunk += pk.pack(o)
    out.append(chunk)
    return b"".join(out)
