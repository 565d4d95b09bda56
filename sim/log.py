"""Session logs: a versioned msgpack stream that records a session so it can be replayed exactly.

Layout (each item one msgpack object, in this order):

1. header: a map `{"magic": "servesim-log", "format": 1, "servesim": version, "scenario": {...}
   (fully resolved), "seed", "policy" (at the start), "compute": {...}, "clock", "workload":
   {"arrival": f64 bytes, "prompt": i64 bytes, "output": i64 bytes, "priority": i64 bytes,
   "cancel_at": f64 bytes, "hash_ids": [[...], ...] or None, "hash_block_size"}}`. The workload is
   embedded, so a log replays without the trace files it was drawn from.
2. events, in simulated-time order, each an array `[kind, t, field, ...]` with the fields of
   `sim.events` in declaration order (arrays as little-endian bytes). The engine records a run
   of identical decode steps as one `steps` event however the session sliced its time, so a
   replay regenerates the same records.
3. every 4,096 events, a checkpoint map `{"crc": crc32, "n": events so far}` over the bytes
   since the previous checkpoint (the first covers the header), so a flipped byte is found and
   located;
4. a footer map `{"footer": true, "n", "step", "now", "summary": {...}}`: where the session
   stood when it was exported, and its summary metrics;
5. an end mark `{"crc", "n", "end": true}`, the last checkpoint, covering the footer.

Since format 2, for a deployment of several instances (`sim.cluster`: replicas, or a disaggregated
prefill/decode pair): the header adds `"cluster": {"mode", "router", "instances": [{"role",
"policy"}, ...]}`; the events are one stream per source, each opened by a `stream` event naming
it: first the deployment's own (-1: routing, user actions, cancellations between instances),
then each instance's, in instance order, each in that instance's simulated-time order; the footer
adds `"at": [[step, now], ...]`, where each instance stood. (Format 1 is format 2 without them.)

A log is written to a temporary file in the target's directory and renamed into place, so an
interrupted export never leaves a half-written log under the final name.
"""

from __future__ import annotations

import struct
import zlib
from operator import attrgetter
from dataclasses import dataclass, fields
from pathlib import Path

import msgpack
import numpy as np

from sim import events as ev
from sim.errors import LogError, ServesimError
from sim.fileio import atomic_open
from sim.gcpause import paused_gc

MAGIC = "servesim-log"
FORMAT = 2
CHECKPOINT_EVERY = 4096
_END = object()
_LE = np.dtype("<f8")
_F64 = struct.Struct("<d")

# Codes are part of the format: new kinds get new codes at the end.
KIND_CODE = {cls.kind: i for i, cls in enumerate(
    (ev.Arrival, ev.Reject, ev.Admit, ev.Steps, ev.FirstToken, ev.Preempt, ev.Finish, ev.Cancel,
     ev.UserAction, ev.Recomputed, ev.Fork, ev.Route, ev.Handoff, ev.Stream), start=1)}
CODE_CLASS = {code: ev.EVENT_TYPES[kind] for kind, code in KIND_CODE.items()}
FIELDS = {code: [f.name for f in fields(cls)] for code, cls in CODE_CLASS.items()}
_ARRAY_FIELDS = ("ends", "durs")  # stored as little-endian float64 bytes
_LEN = {code: len(names) + 1 for code, names in FIELDS.items()}


# --- events <-> records --------------------------------------------------------------------------
def _encoder(code: int):
    names = FIELDS[code]
    get = attrgetter(*names)
    if CODE_CLASS[code] is ev.Steps:
        def enc(e, code=code):
            return [code, e.t, e.step, e.ends.tobytes() if e.ends.dtype == _LE else _f64(e.ends),
                    [list(c) for c in e.prefill] if e.prefill else [], list(e.decode), e.tokens,
                    e.kv_used, None if e.durs is None else _f64(e.durs)]
    else:
        def enc(e, code=code, get=get):
            return [code, *get(e)]
    return enc


def _f64(a) -> bytes:
    return np.ascontiguousarray(a, dtype="<f8").tobytes()


_ENCODERS = {cls: _encoder(code) for code, cls in CODE_CLASS.items()}


def encode(e: ev.Event) -> list:
    """An event as the plain array stored in a log."""
    return _ENCODERS[type(e)](e)


def decode(rec) -> ev.Event:
    """A stored array back into an event. Raises ValueError when it has the wrong shape."""
    if not isinstance(rec, list) or not rec or rec[0] not in CODE_CLASS:
        raise ValueError(f"not an event record: {str(rec)[:60]}")
    code = rec[0]
    names = FIELDS[code]
    if len(rec) != len(names) + 1:
        raise ValueError(f"{CODE_CLASS[code].kind} record has {len(rec) - 1} fields, "
                         f"expected {len(names)}")
    kw = {}
    for name, v in zip(names, rec[1:]):
        if name in _ARRAY_FIELDS and v is not None:
            if not isinstance(v, bytes) or len(v) % 8:
                raise ValueError(f"field {name} is not a float64 array")
            v = np.frombuffer(v, dtype="<f8")
        elif name in ("prefill", "decode"):
            if not isinstance(v, list):
                raise ValueError(f"field {name} is not a list")
            v = tuple(tuple(x) if isinstance(x, list) else x for x in v)
        elif name == "t" and not isinstance(v, (int, float)):
            raise ValueError("field t is not a number")
        kw[name] = v
    return CODE_CLASS[code](**kw)


# --- writing -------------------------------------------------------------------------------------
def _workload_header(w) -> dict:
    return {
        "arrival": np.ascontiguousarray(w.arrival, np.float64).tobytes(),
        "prompt": np.ascontiguousarray(w.prompt, np.int64).tobytes(),
        "output": np.ascontiguousarray(w.output, np.int64).tobytes(),
        "priority": np.ascontiguousarray(w.priority, np.int64).tobytes(),
        "cancel_at": np.ascontiguousarray(w.cancel_at, np.float64).tobytes(),
        "hash_ids": None if w.hash_ids is None else [list(h) for h in w.hash_ids],
        "hash_block_size": w.hash_block_size,
        "prefix_group": None if w.prefix_group is None else _i64(w.prefix_group),
        "prefix_tokens": w.prefix_tokens,
    }


def _i64(a) -> bytes:
    return np.ascontiguousarray(a, dtype="<i8").tobytes()


def header_for(engine) -> dict:
    from sim import __version__

    sc = engine.scenario
    header = {
        "magic": MAGIC, "format": FORMAT, "servesim": __version__,
        "scenario": sc.to_dict(), "seed": sc.seed, "policy": engine.initial_policy,
        "compute": sc.to_dict()["compute"], "clock": engine.clock,
        "workload": _workload_header(engine.workload),
    }
    cluster = getattr(engine, "log_header", None)  # a deployment of several instances
    if cluster is not None:
        header["cluster"] = cluster()
    return header


def write_log(path, engine, summary: dict | None = None) -> Path:
    """Write `engine`'s session so far to `path` (atomically). Returns the path.

    Raises LogError with one line naming the file when it cannot be written.
    """
    path = Path(path)
    if summary is None:
        from sim.metrics import summarize

        summary = summarize(engine)
    packer = msgpack.Packer(use_bin_type=True)
    try:
        with atomic_open(path, "wb") as fh, paused_gc():
            chunk = [packer.pack(header_for(engine))]
            n = 0
            streams = getattr(engine, "log_events", None)
            for e in streams() if streams is not None else engine.events:
                chunk.append(packer.pack(encode(e)))
                n += 1
                if n % CHECKPOINT_EVERY == 0:
                    body = b"".join(chunk)
                    fh.write(body)
                    fh.write(packer.pack({"crc": zlib.crc32(body), "n": n}))
                    chunk = []
            footer = {"footer": True, "n": n, "step": engine.step_count, "now": engine.now,
                      "summary": summary}
            if streams is not None:
                footer["at"] = engine.position()
            chunk.append(packer.pack(footer))
            body = b"".join(chunk)
            fh.write(body)
            fh.write(packer.pack({"crc": zlib.crc32(body), "n": n, "end": True}))
    except ServesimError as e:
        raise LogError(str(e)) from None
    return path


# --- reading -------------------------------------------------------------------------------------
@dataclass
class SessionLog:
    path: str
    header: dict
    records: list        # encoded events, as stored
    footer: dict
    size_bytes: int

    @property
    def events(self) -> list[ev.Event]:
        return [decode(r) for r in self.records]

    def workload(self):
        from sim.workload import Workload

        w = self.header["workload"]
        return Workload(
            arrival=np.frombuffer(w["arrival"], np.float64).copy(),
            prompt=np.frombuffer(w["prompt"], np.int64).copy(),
            output=np.frombuffer(w["output"], np.int64).copy(),
            priority=np.frombuffer(w["priority"], np.int64).copy(),
            cancel_at=np.frombuffer(w["cancel_at"], np.float64).copy(),
            hash_ids=None if w["hash_ids"] is None else [tuple(h) for h in w["hash_ids"]],
            hash_block_size=w["hash_block_size"],
            prefix_group=(None if w.get("prefix_group") is None
                          else np.frombuffer(w["prefix_group"], "<i8").astype(np.int64)),
            prefix_tokens=w.get("prefix_tokens", 0),
        )


def _check_header(path: str, header) -> None:
    if not isinstance(header, dict) or header.get("magic") != MAGIC:
        raise LogError(f"{path}: not a servesim session log (no header at byte 0)")
    fmt = header.get("format")
    if not isinstance(fmt, int):
        raise LogError(f"{path}: header has no format version")
    if fmt > FORMAT:
        raise LogError(f"{path}: log format {fmt} is newer than this servesim reads ({FORMAT}); "
                       "upgrade servesim")
    for key in ("scenario", "policy", "workload", "clock"):
        if key not in header:
            raise LogError(f"{path}: header lacks {key!r}")
    w = header["workload"]
    try:
        sizes = {k: len(w[k]) for k in ("arrival", "prompt", "output", "priority", "cancel_at")}
    except (KeyError, TypeError):
        raise LogError(f"{path}: header's workload is malformed") from None
    if len(set(sizes.values())) != 1 or sizes["arrival"] % 8:
        raise LogError(f"{path}: header's workload arrays differ in length")


def read_log(path) -> SessionLog:
    """Read and check a session log. Raises LogError naming the file and where it is wrong."""
    with paused_gc():
        return _read_log(str(path))


def _read_log(path: str) -> SessionLog:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise LogError(f"{path}: cannot read: {e.strerror or e}") from None
    if not data:
        raise LogError(f"{path}: empty file, not a servesim session log")
    up = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=len(data) + 16)
    up.feed(data)

    def next_obj(what: str):
        at = up.tell()
        try:
            return next(up), at
        except StopIteration:
            if at < len(data):
                raise LogError(f"{path}: truncated at byte {len(data)} inside {what} "
                               f"(which starts at byte {at})") from None
            raise LogError(f"{path}: truncated at byte {at}: no footer after {what}") from None
        except (ValueError, TypeError, RecursionError, msgpack.UnpackException,
                msgpack.ExtraData) as e:
            raise LogError(f"{path}: corrupt at byte {at} ({what}): {e}") from None

    try:
        header, _ = next_obj("the header")
    except LogError:
        if MAGIC.encode() in data[:64]:  # ours, but cut or damaged inside the header
            raise
        raise LogError(f"{path}: not a servesim session log (unreadable header)") from None
    _check_header(path, header)
    records, footer = [], None
    chunk_start = 0  # the first checkpoint covers the header too
    append = records.append
    packb = msgpack.Packer(use_bin_type=True).pack
    while True:
        # Event records (lists) stream through this tight loop; maps end it.
        obj = _END
        try:
            for obj in up:
                if type(obj) is not list:
                    break
                append(obj)
            else:
                obj = _END
        except (ValueError, TypeError, RecursionError, msgpack.UnpackException,
                msgpack.ExtraData) as e:
            raise LogError(f"{path}: corrupt at byte {up.tell()} (event {len(records)}): "
                           f"{e}") from None
        i = len(records)
        if obj is _END:
            at = up.tell()
            where = f"inside event {i} (at byte {at})" if at < len(data) else f"after event {i}"
            raise LogError(f"{path}: truncated at byte {len(data)}: {where}, no end mark")
        at = up.tell() - len(packb(obj)) if isinstance(obj, dict) else up.tell()
        if isinstance(obj, dict) and "crc" in obj:
            # A checkpoint covers the bytes before it, not itself: check its own shape exactly.
            if set(obj) not in ({"crc", "n"}, {"crc", "n", "end"}) or obj.get("end", True) is not True:
                raise LogError(f"{path}: malformed checkpoint at byte {at}: the log is corrupt")
            if obj.get("crc") != zlib.crc32(data[chunk_start:at]) or obj.get("n") != i:
                raise LogError(f"{path}: checksum mismatch in bytes {chunk_start}..{at} "
                               f"(events before {i}): the log is corrupt")
            chunk_start = up.tell()
            if obj.get("end"):
                break
            continue
        if footer is None and isinstance(obj, dict) and obj.get("footer"):
            footer = obj
            continue
        raise LogError(f"{path}: unexpected {type(obj).__name__} at byte {at} (event {i})")
    for i, r in enumerate(records):
        if not r or type(r[0]) is not int or _LEN.get(r[0]) != len(r):
            raise LogError(f"{path}: event {i}: not an event record")
    if footer is None:
        raise LogError(f"{path}: no footer before the end mark")
    if up.tell() != len(data):
        raise LogError(f"{path}: {len(data) - up.tell()} unexpected bytes after the end "
                       f"at byte {up.tell()}")
    for key in ("step", "now"):
        if not isinstance(footer.get(key), (int, float)):
            raise LogError(f"{path}: footer lacks {key!r}")
    return SessionLog(path, header, records, footer, len(data))
