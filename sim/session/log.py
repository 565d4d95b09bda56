"""Session logs: a versioned msgpack stream that records a session so it can be replayed exactly.

Layout (each item one msgpack object, in this order):

1. header: a map `{"magic": "servesim-log", "format": 1, "servesim": version, "scenario": {...}
   (fully resolved), "seed", "policy" (at the start), "compute": {...}, "clock", "workload":
   {"arrival": f64 bytes, "prompt": i64 bytes, "output": i64 bytes, "priority": i64 bytes,
   "cancel_at": f64 bytes, "hash_ids": [[...], ...] or None, "hash_block_size"}}`. The workload is
   embedded, so a log replays without the trace files it was drawn from.
2. events, in simulated-time order, each an array `[kind, t, field, ...]` with the fields of
   `sim.engine.events` in declaration order (arrays as little-endian bytes). The engine records a run
   of identical decode steps as one `steps` event however the session sliced its time, so a
   replay regenerates the same records.
3. every 4,096 events, a checkpoint map `{"crc": crc32, "n": events so far}` over the bytes
   since the previous checkpoint (the first covers the header), so a flipped byte is found and
   located;
4. a footer map `{"footer": true, "n", "step", "now", "settled", "summary": {...}}`: where the
   session stood when it was exported, whether the arrivals and client cancellations due by
   then had been applied (`Engine.settled`; logs written before it lack it: not), and its
   summary metrics;
5. an end mark `{"crc", "n", "end": true}`, the last checkpoint, covering the footer.

Since format 2, for a deployment of several instances (`sim.deploy.cluster`: replicas, or a disaggregated
prefill/decode pair): the header adds `"cluster": {"mode", "router", "instances": [{"role",
"policy"}, ...]}`; the events are one stream per source, each opened by a `stream` event naming
it: first the deployment's own (-1: routing, user actions, cancellations between instances),
then each instance's, in instance order, each in that instance's simulated-time order; the footer
adds `"at": [[step, now], ...]`, where each instance stood, and its `settled` is one flag for
the deployment's own stream and one per instance (`Cluster.settled`). (Format 1 is format 2
without them.) A user action's args carry `settled` as the footer does, where it took effect.

A log is written to a temporary file in the target's directory and renamed into place, so an
interrupted export never leaves a half-written log under the final name.
"""

from __future__ import annotations

import io
import math
import os
import stat
import struct
import zlib
from operator import attrgetter
from dataclasses import dataclass, fields
from pathlib import Path

import msgpack
import numpy as np

from sim.engine import events as ev
from sim.errors import LogError, ServesimError, shown
from sim.fileio import atomic_open, open_input, read_bounded
from sim.gcpause import paused_gc
from sim.limits import INT64_MAX, MAX_INJECT_COUNT, MAX_TIME_S, MAX_TOKENS, PRIORITY_RANGE
from sim import __version__
from sim.inputs.scenario import ComputeConfig, DEPLOYMENT_POLICIES, Scenario, SECTIONS
from sim.policies import POLICIES
from sim.deploy.cluster import deployment_header, MODES, ROLES
from sim.deploy.routers import ROUTERS
from sim.stats.metrics import summarize
from sim.inputs.workload import Workload

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
_ACTION_CODE, _STEPS_CODE = KIND_CODE["action"], KIND_CODE["steps"]
_STREAM_CODE = KIND_CODE["stream"]


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


def decode(rec, check: bool = True) -> ev.Event:
    """A stored array back into an event. Raises ValueError naming the field when the record
    has the wrong shape or a field of the wrong type or range (see `check_record`; `check=False`
    for records the engine itself made)."""
    if check:
        check_record(rec)
    code = rec[0]
    kw = {}
    for name, v in zip(FIELDS[code], rec[1:]):
        if name in _ARRAY_FIELDS and v is not None:
            v = np.frombuffer(v, dtype="<f8")
        elif name in ("prefill", "decode"):
            v = tuple(tuple(x) if isinstance(x, list) else x for x in v)
        kw[name] = v
    return CODE_CLASS[code](**kw)


# --- what a record may hold ----------------------------------------------------------------------
# Every field of every event is checked by type and range when a log is read, so that a crafted
# log (valid checksums, wrong contents) is refused with one line instead of failing somewhere
# downstream. Checks go by field name; a field added later is checked by its annotation.
def _is_int(lo: int, hi: int):
    return lambda v: type(v) is int and lo <= v <= hi


def _is_time(v) -> bool:
    return type(v) in (int, float) and 0 <= v <= 2 * MAX_TIME_S  # (NaN fails)


def _is_str(v) -> bool:
    return type(v) is str and len(v) <= 4096


def _is_times(v) -> bool:
    """Little-endian float64 times, each finite and in range."""
    if type(v) is not bytes or not v or len(v) % 8:
        return False
    if len(v) == 8:  # one step: most records
        return 0 <= _F64.unpack(v)[0] <= 2 * MAX_TIME_S
    a = np.frombuffer(v, dtype="<f8")
    return bool(a.min() >= 0) and bool(a.max() <= 2 * MAX_TIME_S)  # (NaN fails)


def _is_ids(v) -> bool:
    """A list of request ids (checked in C: a page of ids costs one pass)."""
    return type(v) is list and (not v or (set(map(type, v)) == {int} and min(v) >= 0
                                          and max(v) <= INT64_MAX))


def is_plain(v, depth: int = 0) -> bool:
    """Plain data (what JSON holds, plus int keys): None, bool, finite int/float, str, lists
    and maps of those, nested at most 16 deep."""
    t = type(v)
    if v is None or t in (bool, str):
        return True
    if t is int:
        return -INT64_MAX - 1 <= v <= INT64_MAX
    if t is float:
        return math.isfinite(v)
    if depth >= 16:
        return False
    if t is list:
        return all(is_plain(x, depth + 1) for x in v)
    if t is dict:
        return all(type(k) in (str, int) and is_plain(x, depth + 1) for k, x in v.items())
    return False


_ID = _is_int(0, INT64_MAX)
_COUNT = _ID
_LENGTH = _is_int(1, MAX_TOKENS)
FIELD_CHECKS = {
    "t": _is_time, "end": _is_time, "req_id": _ID, "parent": _ID, "child": _ID,
    "prompt_len": _LENGTH, "max_output_tokens": _LENGTH, "priority": _is_int(*PRIORITY_RANGE),
    "step": _COUNT, "kv_used": _COUNT, "blocks": _COUNT, "instance": _is_int(-1, INT64_MAX),
    "ends": _is_times, "durs": lambda v: v is None or _is_times(v),
    "prefill": lambda v: type(v) is list and all(
        type(c) is list and len(c) == 3 and _is_ids(c) for c in v),
    "decode": _is_ids,
    "tokens": lambda v: v is None or (type(v) is dict and _is_ids(list(v)) and all(
        _is_ids(x) for x in v.values())),
    "args": lambda v: type(v) is dict and all(type(k) is str for k in v),  # (see _ACTION_ARGS)
}
_BY_TYPE = {"int": _is_int(-INT64_MAX - 1, INT64_MAX), "float": _is_time,
            "str": _is_str, "bool": lambda v: type(v) is bool}
_CHECKS = {code: [(n, FIELD_CHECKS.get(n) or _BY_TYPE.get(f.type, is_plain))
                  for n, f in zip(names, fields(CODE_CLASS[code]))]
           for code, names in FIELDS.items()}


def check_record(rec) -> None:
    """Raise ValueError naming the field when `rec` is not a well-formed event record."""
    if type(rec) is not list or not rec or type(rec[0]) is not int or rec[0] not in CODE_CLASS:
        raise ValueError(f"not an event record: {shown(rec, 60)}")
    checks = _CHECKS[rec[0]]
    if len(rec) != len(checks) + 1:
        raise ValueError(f"{CODE_CLASS[rec[0]].kind} record has {len(rec) - 1} fields, "
                         f"expected {len(checks)}")
    for (name, ok), v in zip(checks, rec[1:]):
        if not ok(v):
            raise ValueError(f"{CODE_CLASS[rec[0]].kind} field {name} = {shown(v)}: "
                             "of the wrong type or out of range")
    if rec[0] == _STEPS_CODE and rec[8] is not None and len(rec[8]) != len(rec[3]):
        raise ValueError(f"steps field durs: {len(rec[8]) // 8} durations, expected one for "
                         f"each of its {len(rec[3]) // 8} steps")


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
        # (a client mix only: the logs of other workloads stay as they were)
        **({} if w.client is None else {"client": _i64(w.client)}),
    }


def _i64(a) -> bytes:
    return np.ascontiguousarray(a, dtype="<i8").tobytes()


def header_for(engine) -> dict:
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


def write_log(path, engine, summary: dict | None = None, exclusive: bool = False,
              records=None) -> Path:
    """Write `engine`'s session so far to `path` (atomically). Returns the path.

    `records`: the session's event records, in order, when not all of them are in the engine's
    lists (`Spool.records`). Raises LogError with one line naming the file when it cannot be
    written; FileExistsError when `exclusive` and `path` exists (it is never replaced then).
    """
    path = Path(path)
    if summary is None:

        summary = summarize(engine)
    packer = msgpack.Packer(use_bin_type=True)
    try:
        with atomic_open(path, "wb", exclusive=exclusive) as fh, paused_gc():
            chunk = [packer.pack(header_for(engine))]
            n = 0
            streams = getattr(engine, "log_events", None)
            if records is None:
                records = map(encode, streams() if streams is not None else engine.events)
            for rec in records:
                chunk.append(packer.pack(rec))
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
            footer["settled"] = engine.settled
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
        """Every record decoded. Raises LogError naming the first malformed one."""
        out = []
        for i, r in enumerate(self.records):
            try:
                out.append(decode(r))
            except ValueError as e:
                raise LogError(f"{self.path}: event {i}: {e}") from None
        return out

    def workload(self):
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
            client=(None if w.get("client") is None
                    else np.frombuffer(w["client"], "<i8").astype(np.int64)),
        )


# The header's fields (`cluster` only since format 2, for a deployment of several instances).
_HEADER_KEYS = ("magic", "format", "servesim", "scenario", "seed", "policy", "compute", "clock",
                "workload")
_MISSING = object()


def _schema(section: str | None, name: str):
    """The scenario loader's own default and choices for a field (section None: top level)."""
    from dataclasses import MISSING

    f = next(f for f in fields(SECTIONS[section] if section else Scenario) if f.name == name)
    default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
    return default, f.metadata.get("choices")


def _scenario_value(scenario: dict, section: str | None, name: str):
    """What loading the header's scenario makes of a field: its value, or the default when it
    is absent; _MISSING when its section is not a table (the loader refuses that itself)."""
    table = scenario if section is None else scenario.get(section, {})
    if type(table) is not dict:
        return _MISSING
    return table.get(name, _schema(section, name)[0])


def _check_header(path: str, header) -> None:
    """Every field of the header: its presence, type and allowed values (the policies, routers,
    roles and clocks the engine knows), and its agreement with the rest of the header (the
    scenario's seed, compute table and deployment); the workload's columns by length and
    value. Raises LogError naming the field."""
    if not isinstance(header, dict) or header.get("magic") != MAGIC:
        raise LogError(f"{path}: not a servesim session log (no header at byte 0)")
    fmt = header.get("format")
    if type(fmt) is not int:
        raise LogError(f"{path}: header has no format version")
    if fmt > FORMAT:
        raise LogError(f"{path}: log format {fmt} is newer than this servesim reads ({FORMAT}); "
                       "upgrade servesim")
    if fmt < 1:
        raise LogError(f"{path}: header: format = {fmt}: no such log format")
    for key in _HEADER_KEYS:
        if key not in header:
            raise LogError(f"{path}: header lacks {key!r}")
    for key in header:
        if key not in _HEADER_KEYS and not (key == "cluster" and fmt >= 2):
            raise LogError(f"{path}: header: unknown field {shown(key, 60)}"
                           + (" (format 1 has no deployments)" if key == "cluster" else ""))

    def bad(key, why, value=_MISSING):
        value = header.get(key) if value is _MISSING else value
        raise LogError(f"{path}: header: {key} = {shown(value, 60)}: {why}")

    policy = header["policy"]
    if type(policy) is not str or policy not in (*POLICIES, *DEPLOYMENT_POLICIES):
        bad("policy", "not a policy")
    _, clocks = _schema("compute", "clock")
    if type(header["clock"]) is not str or header["clock"] not in clocks:
        bad("clock", f"expected {' or '.join(map(repr, clocks))}")
    for key in ("scenario", "compute"):
        if not (type(header[key]) is dict and is_plain(header[key])):
            bad(key, "expected a table of plain values")
    scenario, compute = header["scenario"], header["compute"]
    if not _is_str(scenario.get("name")):  # (the exports show it)
        bad("scenario.name", "expected a string", scenario.get("name"))
    if not _ID(header["seed"]):
        bad("seed", "expected a non-negative integer")
    seed = _scenario_value(scenario, None, "seed")
    if header["seed"] != seed:
        bad("seed", f"differs from the scenario's seed = {shown(seed)}")
    if not _is_str(header["servesim"]):
        bad("servesim", "expected a version string")
    # `compute` is the scenario's [compute] table (the CLI reads its backend before the scenario
    # is loaded), and `clock` its clock.
    _, backends = _schema("compute", "backend")
    if compute.get("backend") not in backends:
        bad("compute.backend", f"expected one of {', '.join(backends)}", compute.get("backend"))

    names = [f.name for f in fields(ComputeConfig)]
    for k, v in compute.items():
        if k not in names:
            bad(f"compute.{k}", "unknown field", v)
    for k in names:
        mine = compute.get(k, _schema("compute", k)[0])
        theirs = _scenario_value(scenario, "compute", k)
        if theirs is not _MISSING and mine != theirs:
            bad(f"compute.{k}", f"differs from the scenario's compute.{k} = {shown(theirs)}",
                mine)
    if header["clock"] != compute.get("clock", _schema("compute", "clock")[0]):
        bad("clock", f"differs from compute.clock = {shown(compute.get('clock'))}")
    clients = _scenario_value(scenario, "workload", "clients")
    _check_workload(path, header["workload"], len(clients) if type(clients) is list else 0)
    if "cluster" in header:
        _check_cluster(path, header)
    elif policy in DEPLOYMENT_POLICIES:
        bad("policy", "a deployment of several instances, but the header lacks 'cluster'")


def _made(scenario: dict) -> tuple[str, str, str, str]:
    """The kind of deployment the header's scenario makes (a disaggregated pair aside): its
    mode, what its instances are, and the field that counts them."""
    if _scenario_value(scenario, "model", "data_parallel") not in (1, _MISSING):
        return "data-parallel", "data-parallel ranks", "model", "data_parallel"
    if _scenario_value(scenario, "model", "pipeline_parallel") not in (1, _MISSING):
        return "pipeline", "virtual engines", "model", "virtual_engines"
    return "replicas", "replicas", "cluster", "replicas"


def _check_cluster(path: str, header: dict) -> None:
    """The header's description of a deployment (`Cluster.log_header`): known modes, router,
    roles and policies, and the deployment the header's policy and scenario make: a
    disaggregated one (`cluster.prefill_instances` prefill then `decode_instances` decode
    instances, all chunked, behind the scenario's router if several prefill), or
    `cluster.replicas` replicas of the header's policy behind the scenario's router."""

    cluster = header["cluster"]

    def bad(key, why, value):
        raise LogError(f"{path}: header: cluster.{key} = {shown(value, 60)}: {why}")

    if type(cluster) is not dict:
        raise LogError(f"{path}: header: cluster = {shown(cluster, 60)}: expected "
                       "{mode, router, instances: [{role, policy}, ...]}")
    for key in ("mode", "router", "instances"):
        if key not in cluster:
            raise LogError(f"{path}: header: cluster lacks {key!r}")
    for key, v in cluster.items():
        if key not in ("mode", "router", "instances"):
            bad(key, "unknown field", v)
    mode, router, instances = cluster["mode"], cluster["router"], cluster["instances"]
    if type(mode) is not str or mode not in MODES:
        bad("mode", f"expected one of {', '.join(map(repr, MODES))}", mode)
    if router is not None and (type(router) is not str or router not in ROUTERS):
        bad("router", f"not a router (one of {', '.join(ROUTERS)})", router)
    if type(instances) is not list or not instances:
        bad("instances", "expected [{role, policy}, ...], one per instance", instances)
    for i, inst in enumerate(instances):
        if type(inst) is not dict or set(inst) != {"role", "policy"}:
            bad(f"instances[{i}]", "expected {role, policy}", inst)
        if type(inst["role"]) is not str or inst["role"] not in ROLES:
            bad(f"instances[{i}].role", f"expected one of {', '.join(ROLES)}", inst["role"])
        if type(inst["policy"]) is not str or inst["policy"] not in POLICIES:
            bad(f"instances[{i}].policy", "not a policy", inst["policy"])
    # The deployment the replay builds from the header's policy and scenario (as the cluster
    # itself writes it).
    policy, scenario = header["policy"], header["scenario"]
    prefill = decode = 1
    if policy == "disaggregated":
        prefill, decode = (_scenario_value(scenario, "cluster", k)
                           for k in ("prefill_instances", "decode_instances"))
        if not all(type(n) is int and n >= 1 for n in (prefill, decode)):
            raise LogError(f"{path}: header: the scenario's cluster.prefill_instances = "
                           f"{shown(prefill)}, decode_instances = {shown(decode)}: expected "
                           "counts of 1 or more")
        count = prefill + decode
        what = (f"a disaggregated deployment ({prefill} prefill, {decode} decode)"
                if count > 2 else "a disaggregated pair (prefill, decode)")
        scenario_router = (_scenario_value(scenario, "cluster", "router") if prefill > 1
                           else None)
        counted = f"{what} has {count}"
    else:
        made, what, section, field = _made(scenario)
        scenario_router = (_scenario_value(scenario, "cluster", "dp_router")
                           if made == "data-parallel" else "least-outstanding"
                           if made == "pipeline" else
                           _scenario_value(scenario, "cluster", "router"))
        count = _scenario_value(scenario, section, field)
        if made == "pipeline" and count == 0:
            count = _scenario_value(scenario, "model", "pipeline_parallel")
        counted = (f"the scenario's {section} is not a table" if count is _MISSING
                   else f"the scenario's {section}.{field} = {shown(count)}")
    want = deployment_header(policy, None if scenario_router is _MISSING else scenario_router,
                             len(instances), made if policy != "disaggregated" else "replicas",
                             prefill, decode)
    if mode != want["mode"]:
        bad("mode", f"expected {want['mode']!r} for policy = {policy!r}", mode)
    if scenario_router is not _MISSING and router != want["router"]:
        bad("router", "expected None (one prefill instance has no router)" if want["router"] is None
            else f"differs from the scenario's cluster.router = {shown(want['router'])}", router)
    if type(count) is not int or count != len(instances):
        raise LogError(f"{path}: header: cluster.instances: {len(instances)} of them, but "
                       f"{counted}")
    for i, (inst, w) in enumerate(zip(instances, want["instances"])):
        role, pol = w["role"], w["policy"]
        if inst["role"] != role:
            bad(f"instances[{i}].role", f"expected {role!r} in {what}", inst["role"])
        if inst["policy"] != pol:
            bad(f"instances[{i}].policy", f"expected {pol!r}, the header's policy"
                if role == "replica" else f"expected {pol!r} in {what}", inst["policy"])


_COLUMNS = {"arrival": "<f8", "prompt": "<i8", "output": "<i8", "priority": "<i8",
            "cancel_at": "<f8"}
_WORKLOAD_KEYS = (*_COLUMNS, "hash_ids", "hash_block_size", "prefix_group", "prefix_tokens",
                  "client")


def _check_workload(path: str, w, num_clients: int) -> None:
    """The embedded workload: columns of one length and sane values (arrivals sorted times,
    lengths 1 to MAX_TOKENS, priorities in range, cancellations after arrival or NaN)."""
    def bad(why):
        raise LogError(f"{path}: header's workload: {why}")

    if type(w) is not dict:
        bad("not a table")
    for k in w:
        if k not in _WORKLOAD_KEYS:
            bad(f"unknown field {shown(k)}")
    if "hash_ids" not in w:
        bad("lacks 'hash_ids'")
    cols = {}
    for k, dt in _COLUMNS.items():
        v = w.get(k)
        if type(v) is not bytes or len(v) % 8:
            bad(f"{k} is not an array of 8-byte values")
        cols[k] = np.frombuffer(v, dtype=dt)
    n = len(cols["arrival"])
    if any(len(c) != n for c in cols.values()):
        bad("its arrays differ in length")
    a = cols["arrival"]
    if n and not (((a >= 0) & (a <= MAX_TIME_S)).all() and (np.diff(a) >= 0).all()):
        bad("arrival: not sorted times from 0 to 1e9 s")
    for k in ("prompt", "output"):
        if n and not ((cols[k] >= 1) & (cols[k] <= MAX_TOKENS)).all():
            bad(f"{k}: lengths must be 1 to {MAX_TOKENS:,}")
    p = cols["priority"]
    if n and not ((p >= PRIORITY_RANGE[0]) & (p <= PRIORITY_RANGE[1])).all():
        bad("priority: out of range")
    c = cols["cancel_at"]
    if n and not (np.isnan(c) | ((c >= a) & (c <= 2 * MAX_TIME_S))).all():
        bad("cancel_at: not NaN or a time after the arrival")
    h = w.get("hash_ids")
    if h is not None and not (type(h) is list and len(h) == n and all(
            type(x) is list and all(type(y) is int and -INT64_MAX - 1 <= y <= INT64_MAX
                                    for y in x) for x in h)):
        bad("hash_ids: expected a list of integer lists, one per request")
    if not _is_int(1, MAX_TOKENS)(w.get("hash_block_size")):
        bad("hash_block_size: expected a positive integer")
    g = w.get("prefix_group")
    if g is not None and (type(g) is not bytes or len(g) != 8 * n
                          or (n and np.frombuffer(g, "<i8").min() < 0)):
        bad("prefix_group: expected one non-negative integer per request")
    if not _is_int(0, MAX_TOKENS)(w.get("prefix_tokens", 0)):
        bad("prefix_tokens: expected a length")
    c = w.get("client")
    if (c is None) != (num_clients == 0) or c is not None and (
            type(c) is not bytes or len(c) != 8 * n or n and not (
                0 <= np.frombuffer(c, "<i8").min() and np.frombuffer(c, "<i8").max() < num_clients)):
        bad(f"client: expected one index of the scenario's {num_clients} workload.clients per "
            "request")


def is_position(v) -> bool:
    """Whether `v` is a deployment's position: [steps run, clock] for each instance (the
    count of instances is the header's to say)."""
    return type(v) is list and all(type(p) is list and len(p) == 2 and _COUNT(p[0])
                                   and _is_time(p[1]) for p in v)


def is_flags(v, n: int) -> bool:
    """Whether `v` is one true or false for each of `n` instances."""
    return type(v) is list and len(v) == n and all(type(x) is bool for x in v)


def _stream_ends(path: str, records: list, marks: list) -> dict:
    """Where each stream's steps end, {stream: (steps run, clock)}, from its last `steps`
    record (stream None: a single engine's log; else the index its marks name)."""
    if marks:  # (a deployment's log opens with one)
        segments = [(records[m][2], m + 1, hi) for m, hi in zip(marks, [*marks[1:], len(records)])]
    else:
        segments = [(None, 0, len(records))]
    out: dict = {}
    for stream, lo, hi in segments:
        out.setdefault(stream, (0, 0.0))
        for j in range(hi - 1, lo - 1, -1):
            r = records[j]
            if r[0] == _STEPS_CODE:
                try:
                    check_record(r)
                except ValueError as e:
                    raise LogError(f"{path}: event {j}: {e}") from None
                out[stream] = (r[2] + len(r[3]) // 8, _F64.unpack(r[3][-8:])[0])
                break
    return out


def _check_footer(path: str, footer: dict, header: dict, records: list, marks: list) -> None:
    """The footer's fields by type and range, and where it says the session stood against
    where its events end: each instance's steps (a deployment's `at`) or the engine's."""
    def bad(key, why, value=_MISSING):
        value = footer.get(key) if value is _MISSING else value
        raise LogError(f"{path}: footer: {key} = {shown(value, 60)}: {why}")

    if footer.get("n") != len(records):
        bad("n", f"expected {len(records)} (the events before it)")
    if not _COUNT(footer.get("step")):
        bad("step", "expected a step count")
    if not _is_time(footer.get("now")) or footer["now"] > MAX_TIME_S:
        bad("now", "expected a time from 0 to 1e9 s")
    if not (type(footer.get("summary")) is dict and is_plain(footer["summary"])):
        bad("summary", "expected a table of plain values")
    at = footer.get("at")
    if at is not None and not is_position(at):
        bad("at", "expected [step, time] per instance")
    ends = _stream_ends(path, records, marks)
    if "cluster" not in header:
        if at is not None:
            bad("at", "a position per instance, but the header has no 'cluster'")
        step, end = ends.get(None, (0, 0.0))
        if footer["step"] != step:
            bad("step", f"the events end at step {step}")
        if footer["now"] < end:
            bad("now", f"before the end of the last step ({end!r})")
        if type(footer.get("settled", False)) is not bool:
            bad("settled", "expected true or false")
        return
    n = len(header["cluster"]["instances"])
    if at is None or len(at) != n:
        bad("at", f"expected [step, time] for each of the {n} instances")
    for k, (step, now) in enumerate(at):
        s, end = ends.get(k, (0, 0.0))
        if step != s:
            bad(f"at[{k}]", f"instance {k}'s events end at step {s}", at[k])
        if now < end:
            bad(f"at[{k}]", f"before the end of instance {k}'s last step ({end!r})", at[k])
    if footer["step"] != sum(p[0] for p in at):
        bad("step", f"expected {sum(p[0] for p in at)} (the instances' steps, summed)")
    if not is_flags(footer.get("settled", [False] * (n + 1)), n + 1):
        bad("settled", f"expected true or false for the deployment and each of its {n} "
                       "instances")


# What each user action carries (`at`: a deployment's instances' positions).
_ACTION_ARGS = {
    "inject": {"prompt_len": _LENGTH, "max_output_tokens": _LENGTH,
               "priority": _is_int(*PRIORITY_RANGE), "count": _is_int(1, MAX_INJECT_COUNT),
               "prompt_text": lambda v: v is None or (type(v) is str and len(v) <= MAX_TOKENS
                                                      and max(v, default="\0") <= "\xff"),
               # (served requests: when the HTTP request arrived, and who sent it)
               "arrival_time": lambda v: _is_time(v) and v <= MAX_TIME_S,
               "tag": lambda v: _is_str(v) and len(v) <= 256},
    "cancel": {"req_id": _ID},
    "cancel_waiting": {},
    "switch_policy": {"policy": lambda v: _is_str(v) and v in _policies(),
                      "previous": lambda v: _is_str(v) and v in _policies()},
}


def _policies():
    return POLICIES


def _check_action(path: str, i: int, rec: list, deployment: bool) -> None:
    action, args = rec[3], rec[4]
    spec = _ACTION_ARGS.get(action)
    if spec is None:
        raise LogError(f"{path}: event {i}: unknown action {shown(action)}")
    for k, v in args.items():
        if k == "at":
            if not is_position(v):
                raise LogError(f"{path}: event {i}: {action} at = {shown(v)}: expected "
                               "[step, time] per instance")
        elif k == "settled":
            # (a deployment's: its own, then one per instance, as many as the replay
            # checks against the header)
            if not ((type(v) is list and is_flags(v, len(v))) if deployment
                    else type(v) is bool):
                raise LogError(f"{path}: event {i}: {action} settled = {shown(v)}: expected "
                               + ("true or false for the deployment and each instance"
                                  if deployment else "true or false"))
        elif k not in spec or not spec[k](v):
            raise LogError(f"{path}: event {i}: {action} {k} = {shown(v)}: unknown or "
                           "out of range")
    missing = [k for k in spec if k not in args and k not in ("priority", "count",
                                                                  "prompt_text", "previous",
                                                                  "arrival_time", "tag")]
    if missing:
        raise LogError(f"{path}: event {i}: {action} lacks {', '.join(missing)}")


# --- reading as it comes ---------------------------------------------------------------------
# msgpack makes an object of every array and map it unpacks: an empty one costs one byte in the
# file and some 60 in memory. So nothing larger than _SMALL_OBJECT is unpacked before its shape
# is known to be what servesim writes (each array and map where an event has one, of a length
# that the record's own contents bound), and the header (large by its workload, not by
# containers) may hold no more arrays and maps than a few tables and a list per request.
_SMALL_OBJECT = 64 << 10
_HEADER_CONTAINERS = 4096  # the scenario, compute and deployment tables
_REQUEST_BYTES = 41  # a request's share of the header: 5 columns of 8 bytes, its hash list


def _bounded(buf, containers: int):
    """The one msgpack object in `buf`, refused (ValueError) once it has made more than
    `containers` arrays and maps."""
    left = [containers]

    def made(obj):
        left[0] -= 1
        if left[0] < 0:
            raise ValueError(f"more than {containers:,} arrays and maps in one object")
        return obj

    return msgpack.unpackb(buf, raw=False, strict_map_key=False, list_hook=made,
                           object_hook=made)


# The kinds of event checked in full as they are read: those whose fields hold arrays or maps
# (steps, actions), and stream marks (which must agree with the header). Every other kind's
# fields are single values.
_CHECKED_AS_READ = frozenset({_STEPS_CODE, _ACTION_CODE, _STREAM_CODE})


def _check_as_read(path: str, i: int, rec: list, deployment: bool) -> None:
    """Raise LogError naming the field unless event `i` is well-formed where it must be as it
    is read: a kind in _CHECKED_AS_READ in full, any other holding no array or map. So what
    the accepted records make stays in proportion to their bytes (an empty array in any field
    is one byte in the file, some 60 in memory)."""
    code = rec[0]
    if code in _CHECKED_AS_READ or any(type(v) is list or type(v) is dict for v in rec):
        try:
            check_record(rec)
        except ValueError as e:
            raise LogError(f"{path}: event {i}: {e}") from None
    if code == _ACTION_CODE:
        _check_action(path, i, rec, deployment)
    elif code == _STREAM_CODE and not deployment:
        raise LogError(f"{path}: event {i}: a stream mark, but the header has no 'cluster' "
                       "(the log of a single engine)")


def _is_container(b: int) -> bool:
    """Whether a msgpack type byte opens an array or a map."""
    return 0x80 <= b <= 0x9F or 0xDC <= b <= 0xDF


def _shaped(path: str, i: int, buf, instances: int) -> None:
    """Raise LogError naming the field when the packed record `buf` (event `i`) is not shaped
    as servesim writes it."""
    try:
        _Shape(buf, instances).record()
    except ValueError as e:
        raise LogError(f"{path}: event {i}: {e}") from None


class _Shape:
    """Walks one packed event record without making its objects: raises ValueError at the first
    array or map where the record has none, or one longer than the record allows."""

    def __init__(self, buf, instances: int) -> None:
        self.buf = buf
        self.up = msgpack.Unpacker(raw=False, strict_map_key=False,
                                   max_buffer_size=len(buf) + 16)
        self.up.feed(buf)
        self.instances = instances

    def _peek(self) -> int:
        return self.buf[self.up.tell()]

    def one(self, what: str) -> None:
        """A single value (no array or map)."""
        if _is_container(self._peek()):
            raise ValueError(f"{what}: an array or map where a single value belongs")
        self.up.skip()

    def array(self, what: str, most: int | None = None) -> int:
        if not 0x90 <= self._peek() <= 0x9F and self._peek() not in (0xDC, 0xDD):
            raise ValueError(f"{what}: expected an array")
        n = self.up.read_array_header()
        if most is not None and n > most:
            raise ValueError(f"{what}: {n:,} items, at most {most:,} here")
        return n

    def record(self) -> None:
        n = self.array("event record", max(_LEN.values()))
        if not n or _is_container(self._peek()):
            raise ValueError("not an event record")
        code = self.up.unpack()
        if type(code) is not int or _LEN.get(code) != n:
            raise ValueError("not an event record")
        batch = 0  # the requests in a step: what its `tokens` may name
        for name in FIELDS[code]:
            if name == "prefill":
                batch += (k := self.array(name))
                for _ in range(k):
                    if self.array(f"{name} chunk", 3) != 3:
                        raise ValueError(f"{name}: a chunk is (req_id, start, tokens)")
                    for _ in range(3):
                        self.one(name)
            elif name == "decode":
                batch += (k := self.array(name))
                for _ in range(k):
                    self.one(name)
            elif name == "tokens" and _is_container(self._peek()):
                if not 0x80 <= self._peek() <= 0x8F and self._peek() not in (0xDE, 0xDF):
                    raise ValueError(f"{name}: expected a map")
                k = self.up.read_map_header()
                if k > batch:
                    raise ValueError(f"{name}: {k:,} requests in a step of {batch:,}")
                for _ in range(k):
                    self.one(name)
                    for _ in range(self.array(name)):
                        self.one(name)
            elif name == "args" and _is_container(self._peek()):
                self._args()
            else:
                self.one(name)

    def _args(self) -> None:
        """A user action's arguments: single values, and lists of at most one per instance
        and the deployment (`settled`) of single values or pairs (`at`)."""
        if not 0x80 <= self._peek() <= 0x8F:  # (a handful of arguments)
            raise ValueError("args: expected a small map")
        for _ in range(self.up.read_map_header()):
            self.one("args")
            if not _is_container(self._peek()):
                self.up.skip()
                continue
            for _ in range(self.array("args", self.instances + 1)):
                if _is_container(self._peek()):
                    if self.array("args", 2) != 2:
                        raise ValueError("args: expected [step, time] pairs")
                    self.one("args")
                self.one("args")


# A log is read whole; past this a file is not one servesim wrote (a full Azure trace's log
# is 8.5 MB).
MAX_LOG_BYTES = 4 << 30


def _read_bytes(path: str) -> bytes:
    """The file's bytes, refusing at once (from its first bytes) what cannot be a log: a
    directory, a device such as /dev/zero, a foreign file; and anything past MAX_LOG_BYTES."""
    try:
        st = os.stat(path)
        if stat.S_ISDIR(st.st_mode):
            raise LogError(f"{path}: is a directory, not a servesim session log")
        with open_input(path) as fh:
            head = fh.read(64)
            if not head:
                raise LogError(f"{path}: empty file, not a servesim session log")
            if MAGIC.encode() not in head:
                raise LogError(f"{path}: not a servesim session log (no header at byte 0)")
            rest = read_bounded(fh, MAX_LOG_BYTES - len(head))
            if len(rest) > MAX_LOG_BYTES - len(head):
                raise LogError(f"{path}: larger than {MAX_LOG_BYTES >> 30} GiB, not a session "
                               "log servesim wrote")
    except OSError as e:
        raise LogError(f"{path}: cannot read: {e.strerror or e}") from None
    return head + rest


def read_log(path, check_events: bool = True) -> SessionLog:
    """Read and check a session log: every field of every record by type and range. Raises
    LogError naming the file and where it is wrong.

    `check_events=False` (for `replay --verify`, which compares every record with the one it
    regenerates and checks those that differ) checks in full only the header, the footer and
    the records that hold arrays and maps or that a replay acts on: steps, user actions and
    stream marks."""
    with paused_gc(freeze=True):  # (the records live as long as the log)
        log = _read_log(str(path))
        if check_events:
            for i, r in enumerate(log.records):
                if r[0] in _CHECKED_AS_READ:  # (checked as they were read)
                    continue
                try:
                    check_record(r)
                except ValueError as e:
                    raise LogError(f"{path}: event {i}: {e}") from None
        return log


def _read_log(path: str) -> SessionLog:
    data = _read_bytes(path)
    # Two readers over the bytes: `sizer` only finds where each object ends (no objects made),
    # so that a large one is checked for its shape before `up` makes it (see _Shape).
    up, sizer = (msgpack.Unpacker(io.BytesIO(data), raw=False, strict_map_key=False,
                                  max_buffer_size=len(data) + 16) for _ in range(2))
    errors = (ValueError, TypeError, RecursionError, msgpack.UnpackException, msgpack.ExtraData)

    def extent(what: str) -> int:
        """Where the next object ends; LogError when it is cut or corrupt."""
        at = up.tell()
        try:
            sizer.skip()
        except msgpack.OutOfData:
            if at < len(data):
                raise LogError(f"{path}: truncated at byte {len(data)} inside {what} "
                               f"(which starts at byte {at})") from None
            raise LogError(f"{path}: truncated at byte {at}: no footer after {what}") from None
        except errors as e:
            raise LogError(f"{path}: corrupt at byte {at} ({what}): {e}") from None
        return sizer.tell()

    try:
        end = extent("the header")
        header = _bounded(memoryview(data)[:end], _HEADER_CONTAINERS + end // _REQUEST_BYTES)
        up.skip()
    except (LogError, *errors) as e:
        if MAGIC.encode() in data[:64]:  # ours, but cut or damaged inside the header
            if isinstance(e, LogError):
                raise
            raise LogError(f"{path}: corrupt at byte 0 (the header): {e}") from None
        raise LogError(f"{path}: not a servesim session log (unreadable header)") from None
    _check_header(path, header)
    instances = len(header["cluster"]["instances"]) if "cluster" in header else 0
    deployment = "cluster" in header
    records, footer = [], None
    chunk_start = 0  # the first checkpoint covers the header too
    append = records.append
    view = memoryview(data)
    skip, tell, unpack = sizer.skip, up.tell, up.unpack
    while True:
        # Each record is checked as it comes (its shape first when large, its kind and length
        # after), so a crafted log is refused having made no more than what it holds.
        try:
            while True:
                at = tell()
                skip()
                end = sizer.tell()
                if end - at > _SMALL_OBJECT:
                    _shaped(path, len(records), view[at:end], instances)
                obj = unpack()
                if type(obj) is not list:
                    break
                if not obj or type(obj[0]) is not int or _LEN.get(obj[0]) != len(obj):
                    raise LogError(f"{path}: event {len(records)}: not an event record")
                _check_as_read(path, len(records), obj, deployment)
                append(obj)
        except msgpack.OutOfData:
            extent(f"event {len(records)}")  # (raises: cut short)
        except errors as e:
            raise LogError(f"{path}: corrupt at byte {at} (event {len(records)}): {e}") from None
        i = len(records)
        if isinstance(obj, dict) and "crc" in obj:
            # A checkpoint covers the bytes before it, not itself: check its own shape exactly.
            if set(obj) not in ({"crc", "n"}, {"crc", "n", "end"}) or obj.get("end", True) is not True:
                raise LogError(f"{path}: malformed checkpoint at byte {at}: the log is corrupt")
            if obj.get("crc") != zlib.crc32(view[chunk_start:at]) or obj.get("n") != i:
                raise LogError(f"{path}: checksum mismatch in bytes {chunk_start}..{at} "
                               f"(events before {i}): the log is corrupt")
            chunk_start = end
            if obj.get("end"):
                break
            continue
        if footer is None and isinstance(obj, dict) and obj.get("footer"):
            footer = obj
            continue
        raise LogError(f"{path}: unexpected {type(obj).__name__} at byte {at} (event {i})")
    # Every record's kind and length here, and in full those of _CHECKED_AS_READ; `read_log`
    # checks the others unless told not to. And the records agree with the header: a measured clock's steps
    # carry their durations (a replay steps by them), a modeled clock's none; stream marks in
    # a deployment's log only.
    measured = header["clock"] == "measured"
    marks = []
    for i, r in enumerate(records):
        code = r[0]
        if code == _STEPS_CODE:
            if (r[-1] is None) is measured:
                raise LogError(
                    f"{path}: header: clock = {header['clock']!r}, but event {i} (steps) "
                    + ("records no step durations" if measured else "records measured durations"))
        elif code == _STREAM_CODE:
            marks.append(i)
    if deployment and records and marks[:1] != [0]:
        raise LogError(f"{path}: event 0: not a stream mark (a deployment's log opens with one)")
    if footer is None:
        raise LogError(f"{path}: no footer before the end mark")
    if up.tell() != len(data):
        raise LogError(f"{path}: {len(data) - up.tell()} unexpected bytes after the end "
                       f"at byte {up.tell()}")
    _check_footer(path, footer, header, records, marks)
    return SessionLog(path, header, records, footer, len(data))
