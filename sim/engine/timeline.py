"""The engine's step timeline: one row per engine step, in NumPy columns cut into chunks of CHUNK
rows, with running totals of every full chunk.

Token times are not stored per token: a request records runs of consecutive steps in which it
received a token, and each token's time is its step's end time here (behind an API server, the
time its clients received it is the step's `out`). That keeps a 4-million-token
trace to a few hundred thousand rows and lets pooled ITL percentiles be computed with weights.
Rows are staged and written to the columns in bulk, since a NumPy write per row would cost
more than the step it records: what differs from step to step (end, duration, blocks used,
energy) in staging columns that a run of decode steps writes in one call (`reserve`,
`commit_decodes`: sim/native/_rows.c with the compiled build), the rest once per run of steps in
Python lists.

When a chunk fills it is sealed: its sums (energy, KV use and empty slots over time, batch sizes)
are added to running totals and its ITL gaps go to a `sim.stats.quantiles.Samples`. The summary reads
the totals plus the unsealed rows, so it never needs the sealed rows again. A timeline with
`keep=False` (a run that keeps no history) then drops them: it holds only the `end` times that
live requests' token times still point into (and, for a deployment, the KV use its peak has not
merged yet), and the columns `sim.rolling` reads (ROLLING) of the rows of the last `window_s`
simulated seconds, so its memory is bounded by what is in flight and by that window, not by the
length of the run.
"""

from __future__ import annotations

import bisect
import math
import struct
from typing import Any, Callable, Literal

import numpy as np

from sim.native import compiled
from sim.errors import EngineError
from sim.stats.quantiles import Samples

COLUMNS = {
    "end": np.float64,         # step end time (s); a token sampled in the step has this time
    "dur": np.float64,         # step duration (s)
    "tokens": np.int64,        # tokens computed in the step (prefill + decode)
    "prefill_tokens": np.int64,
    "batch": np.int32,         # sequences in the step
    "sampled": np.int32,       # tokens sampled (first tokens + decodes)
    "itl_count": np.int32,     # sampled tokens whose previous token came from the step before
    "kv_used": np.int32,       # blocks in use at the end of the step
    "kv_empty": np.int64,      # slots of those blocks holding no token (fragmentation)
    "energy": np.float64,      # joules spent in the step
    "waiting": np.int32,       # queue length when the step was scheduled
    # behind an API server (sim.engine.frontend), when it handed the step's tokens to their
    # clients (0 without one)
    "out": np.float64,
}
NAMES = tuple(COLUMNS)
CHUNK = 1 << 16  # rows per chunk (a power of two: chunk sums are of fixed row ranges)
# Rows staged before they are written to the columns: a flush costs ~0.3 ms of NumPy calls
# besides ~0.1 us a row, so 16k rows a flush halve the timeline's cost of 2k (the engine also
# flushes at the end of each run_until)
_STAGE = 1 << 14
# sim/native/_rows.c with the compiled build (the flush's per-row columns in one pass), else None
_ROWS: Any = compiled.c_module("sim.native._rows")
ITL_EXACT_ROWS = 1 << 19  # steps whose ITL gaps are held exactly (then: sim.stats.quantiles' sketch)
# The columns `sim.stats.metrics.rolling` reads: sealed rows of the rolling window keep these
# (keep=False)
ROLLING = ("end", "itl_count", "sampled", "batch")


def _ints(values: list[int]) -> np.ndarray:
    """A list of ints as an int64 array (packed: a third of what np.array costs on a list)."""
    return np.frombuffer(struct.pack(f"{len(values)}q", *values), dtype=np.int64)


TOTALS = ("rows", "energy", "used_dur", "empty_dur", "batch_sum", "batch_max", "used_max")


class Totals:
    """Sums over a span of rows, the figures `sim.stats.metrics.summarize` needs."""

    __slots__ = TOTALS

    def __init__(self) -> None:
        self.rows = 0
        self.energy = 0.0      # joules
        self.used_dur = 0.0    # sum of kv_used * dur (block-seconds)
        self.empty_dur = 0.0   # sum of kv_empty * dur (slot-seconds)
        self.batch_sum = 0
        self.batch_max = 0
        self.used_max = 0

    def add(self, c: dict, k: int) -> None:
        """Add the first `k` rows of columns `c`."""
        if not k:
            return
        dur = c["dur"][:k]
        used = c["kv_used"][:k]
        batch = c["batch"][:k]
        self.rows += k
        self.energy += float(c["energy"][:k].sum())
        self.used_dur += float((used * dur).sum())
        self.empty_dur += float((c["kv_empty"][:k] * dur).sum())
        self.batch_sum += int(batch.sum())
        self.batch_max = max(self.batch_max, int(batch.max()))
        self.used_max = max(self.used_max, int(used.max()))

    def plus(self, other: "Totals") -> "Totals":
        out = Totals()
        for name in TOTALS:  # (a compiled class has no __slots__ to read)
            a, b = getattr(self, name), getattr(other, name)
            setattr(out, name, max(a, b) if name.endswith("_max") else a + b)
        return out


class Timeline:
    """Append-only columns, one entry per engine step.

    `keep=False` drops sealed rows that no reader needs (see the module docstring); `pinned()`
    then names the first row whose end time a live request still needs (math.inf: none); with
    a `window_s`, the ROLLING columns of the rows ending within it of the last sealed row are
    kept too, and the end time of the row before them.
    """

    def __init__(self, keep: bool = True, pinned=None, window_s: float | None = None) -> None:
        self.keep = keep
        self.pinned = pinned
        self.window_s = window_s
        self.hold_kv = False  # keep (end, kv_used) of sealed rows until `release_kv` (a cluster)
        self.on_seal: Callable[[], None] | None = None  # called after a write that sealed chunks
        self._stage_columns(_STAGE + 1024)
        self._stage_reset()
        self._tail = {k: np.zeros(min(4096, CHUNK), dtype=t) for k, t in COLUMNS.items()}
        self._tail_n = 0
        self._chunks: list[dict] = []  # sealed chunks still held, oldest first
        self._first = 0                # row index of _chunks[0][...][0] (or of the tail)
        self.sealed = Totals()         # totals of every sealed row
        self.itl = Samples(ITL_EXACT_ROWS)  # ITL gaps and token counts of sealed rows >= 1
        self._last_end = math.nan      # end time of the last sealed row
        # Behind an API server: the same gaps as its clients see them (from `out`)
        self.client = False
        self.client_itl = Samples(ITL_EXACT_ROWS)
        self._last_out = math.nan
        self._kv_from = 0              # first row not yet released by release_kv

    # --- writing --------------------------------------------------------------------------------
    @property
    def n(self) -> int:
        """Number of steps recorded."""
        return self.sealed.rows + self._tail_n + self._s_k

    @property
    def first(self) -> int:
        """Index of the first row still held (0 unless `keep=False` dropped some)."""
        return self._first

    def _stage_columns(self, cap: int) -> None:
        # Per step, rows [0, _s_k): end, dur, kv_used, energy, out.
        self._s_cap = cap
        self._s_end = np.zeros(cap, dtype=np.float64)
        self._s_out = np.zeros(cap, dtype=np.float64)
        self._s_dur = np.zeros(cap, dtype=np.float64)
        self._s_used = np.zeros(cap, dtype=np.int64)
        self._s_energy = np.zeros(cap, dtype=np.float64)
        # (a single step's values go in through memoryviews: a NumPy item write costs 3x)
        self._m_end: Any = self._s_end.data
        self._m_dur: Any = self._s_dur.data
        self._m_used: Any = self._s_used.data
        self._m_energy: Any = self._s_energy.data
        self._m_out: Any = self._s_out.data

    def _stage_reset(self) -> None:
        # Per staged run of rows (a single step, or a run of decode steps, which shares them):
        # its length, tokens, prefill_tokens, batch, sampled and waiting; and what its
        # itl_count and kv_empty follow from (`flush`): the first row's itl_count (the
        # others': batch), and row j's kv_empty as base - batch * j + per_block * kv_used[j]
        # (+ first, in row 0).
        self._s_k = 0
        self._s_rows: list[int] = []
        self._s_tokens: list[int] = []
        self._s_prefill: list[int] = []
        self._s_batch: list[int] = []
        self._s_sampled: list[int] = []
        self._s_waiting: list[int] = []
        self._s_itl: list[int] = []
        self._s_e_base: list[int] = []
        self._s_e_block: list[int] = []
        self._s_e_first: list[int] = []

    def add_row(self, end: float, dur: float, tokens: int, prefill_tokens: int, batch: int,
                sampled: int, itl_count: int, kv_used: int, kv_empty: int, energy: float,
                waiting: int, out: float = 0.0) -> None:
        """Append one step (the fields of COLUMNS)."""
        j = self.reserve(1)
        self._m_end[j] = end
        self._m_out[j] = out
        self._m_dur[j] = dur
        self._m_used[j] = kv_used
        self._m_energy[j] = energy
        self._s_k = j + 1
        self._stage_run(1, tokens, prefill_tokens, batch, sampled, waiting, itl_count,
                        kv_empty, 0, 0)

    def add_decodes(self, ends: list[float], durs: list[float], batch: int, itl_first: int,
                    kv_used: list[int], empty_base: int, block_size: int, empty_first: int,
                    energy: list[float], waiting: int, outs: list[float] | None = None) -> None:
        """Append a run of decode-only steps of `batch` sequences (one token each; the first
        step has `itl_first` tokens that follow a token of the step before, the others
        `batch`): per-step end times, durations, blocks used and energies. Step j has
        empty_base - batch * j + block_size * kv_used[j] empty slots (`empty_first` more in
        step 0): the slots of the blocks used less the tokens they hold, which grow by
        `batch` a step. `outs`: behind an API server, when each step's tokens were handed
        out."""
        k = len(ends)
        j = self.reserve(k)
        self._s_end[j:j + k] = ends
        if outs is not None:
            self._s_out[j:j + k] = outs
        self._s_dur[j:j + k] = durs
        self._s_used[j:j + k] = kv_used
        self._s_energy[j:j + k] = energy
        self.commit_decodes(j, k, batch, itl_first, empty_base, block_size, empty_first,
                            waiting)

    def reserve(self, k: int) -> int:
        """The first of `k` staging rows free to write (end, dur, kv_used, energy) before
        `commit_decodes` stages them."""
        j = self._s_k
        if j + k > self._s_cap:
            self.flush()
            j = 0
            if k > self._s_cap:
                self._stage_columns(k)
        return j

    def commit_decodes(self, j: int, k: int, batch: int, itl_first: int, empty_base: int,
                       block_size: int, empty_first: int, waiting: int) -> None:
        """Stage the run of `k` decode steps written to rows j.. of the staging columns
        (`add_decodes` says what the rest means)."""
        if j != self._s_k:  # (a flush between reserve and now: the rows move up)
            for col in (self._s_end, self._s_dur, self._s_used, self._s_energy, self._s_out):
                col[self._s_k:self._s_k + k] = col[j:j + k].copy()
        self._s_k += k
        self._stage_run(k, batch, 0, batch, batch, waiting, itl_first, empty_base,
                        block_size, empty_first)

    def _stage_run(self, rows: int, tokens: int, prefill_tokens: int, batch: int,
                   sampled: int, waiting: int, itl_first: int, empty_base: int,
                   per_block: int, empty_first: int) -> None:
        """Stage what a run of `rows` rows, their per-step columns staged, shares (see
        `_stage_reset`); write the stage to the columns once it is full."""
        self._s_rows.append(rows)
        self._s_tokens.append(tokens)
        self._s_prefill.append(prefill_tokens)
        self._s_batch.append(batch)
        self._s_sampled.append(sampled)
        self._s_waiting.append(waiting)
        self._s_itl.append(itl_first)
        self._s_e_base.append(empty_base)
        self._s_e_block.append(per_block)
        self._s_e_first.append(empty_first)
        if self._s_k >= _STAGE:
            self.flush()

    def append(self, **cols) -> int:
        """Append k rows (every column a scalar, or an array or list of length k).

        Returns the index of the first new row.
        """
        self.flush()
        i = self.n
        # (a list is a column, not a scalar: _write splits columns where a chunk fills)
        rows = {}
        for name in NAMES:
            v = cols.get(name, 0)
            rows[name] = np.asarray(v) if isinstance(v, (list, tuple)) else v
        self._write(rows, len(cols["end"]))
        return i

    def flush(self) -> None:
        """Write the staged rows to the columns now (they are written when the stage fills,
        or before anything reads the columns, in any case)."""
        k = self._s_k
        if k:
            # (no nested functions here: compiled, their shared environment is a reference
            # cycle, which the paused collector leaves, arrays and all, until the run ends)
            used = self._s_used[:k]
            if _ROWS is not None:  # (sim/native/_rows.c: the same columns in one pass in C)
                out = [np.empty(k, dtype=np.int64) for _ in range(7)]
                _ROWS.expand([self._s_rows, self._s_tokens, self._s_prefill, self._s_batch,
                              self._s_sampled, self._s_waiting, self._s_itl, self._s_e_base,
                              self._s_e_block, self._s_e_first], used, k, out)
                tokens, prefill, batch, sampled, itl, empty, waiting = out
            else:
                rows = _ints(self._s_rows)
                run = np.repeat(np.arange(len(rows)), rows)  # each row's run
                # (one repeat, then a gather per column: np.repeat costs ~30 ns a row)
                starts = np.cumsum(rows) - rows  # each run's first row
                batch = _ints(self._s_batch)[run]
                itl = batch.copy()
                itl[starts] = _ints(self._s_itl)
                j = np.arange(k, dtype=np.int64) - starts[run]  # row within its run
                empty = (_ints(self._s_e_base)[run] - batch * j
                         + _ints(self._s_e_block)[run] * used)
                empty[starts] += _ints(self._s_e_first)
                tokens = _ints(self._s_tokens)[run]
                prefill = _ints(self._s_prefill)[run]
                sampled = _ints(self._s_sampled)[run]
                waiting = _ints(self._s_waiting)[run]
            cols = {"end": self._s_end[:k], "dur": self._s_dur[:k], "tokens": tokens,
                    "prefill_tokens": prefill, "batch": batch, "sampled": sampled,
                    "itl_count": itl, "kv_used": used, "kv_empty": empty,
                    "energy": self._s_energy[:k], "waiting": waiting, "out": self._s_out[:k]}
            self._stage_reset()
            self._write(cols, k)

    def _write(self, cols: dict, k: int) -> None:
        """Write k rows (each column a scalar or an array of length k) to the tail,
        sealing it each time it fills."""
        done = 0
        sealed = False
        while done < k:
            tail, at = self._tail, self._tail_n
            cap = len(tail["end"])
            if at == cap:
                self._grow_tail(at + (k - done))
                tail, cap = self._tail, len(self._tail["end"])
            m = min(cap - at, k - done)
            for name, v in cols.items():
                if isinstance(v, np.ndarray):
                    tail[name][at:at + m] = v[done:done + m]
                else:  # a scalar for every row
                    tail[name][at:at + m] = v
            self._tail_n = at + m
            done += m
            if self._tail_n == CHUNK:
                self._seal()
                sealed = True
        # Only now, with every row written: a reader called back mid-write (a deployment
        # merging its instances' KV use) would take the rows not yet written, which end before
        # the engine's clock, for rows still to come.
        if sealed and self.on_seal is not None:
            self.on_seal()

    def _grow_tail(self, need: int) -> None:
        cap = len(self._tail["end"])
        new = min(CHUNK, max(cap * 2, need))
        for k, col in self._tail.items():
            grown = np.zeros(new, dtype=col.dtype)
            grown[:cap] = col
            self._tail[k] = grown

    def _seal(self) -> None:
        """Fold the full tail into the totals and the ITL samples; keep what is still needed."""
        c = self._tail
        self.sealed.add(c, CHUNK)
        gaps, counts = self._gaps(c["end"], c["itl_count"], self._last_end)
        self.itl.extend(gaps, counts)
        self._last_end = float(c["end"][-1])
        if self.client:
            gaps, counts = self._gaps(c["out"], c["itl_count"], self._last_out)
            self.client_itl.extend(gaps, counts)
            self._last_out = float(c["out"][-1])
        self._chunks.append(c if self.keep else self._held(
            c, ("end",) if self.window_s is None else ROLLING))
        self._tail = {k: np.zeros(CHUNK, dtype=t) for k, t in COLUMNS.items()}
        self._tail_n = 0
        if not self.keep:
            self._trim()

    def _held(self, c: dict, names: tuple) -> dict:
        """The columns `names` of chunk `c`, and its KV use while a deployment needs it."""
        held = {name: c[name] for name in names}
        if self.hold_kv:
            held["kv_used"] = c["kv_used"]
        return held

    def _gaps(self, ends: np.ndarray, counts: np.ndarray,
              last: float) -> tuple[np.ndarray, np.ndarray]:
        """The ITL gaps of rows (token times `ends`, following a last sealed row of time
        `last`: NaN, none) from row 1 on, with their token counts."""
        if math.isnan(last):
            return ends[1:] - ends[:-1], counts[1:]
        return np.diff(ends, prepend=last), counts

    def _trim(self) -> None:
        """Drop the sealed chunks (oldest first) whose rows no reader needs any more, and the
        ROLLING columns of those the rolling window has left. (The window only moves on:
        `sim.rolling` reads the rows ending at or after its start, and the end time of the
        row before them.)"""
        keep_from = min(self.pinned() if self.pinned is not None else math.inf,
                        self._kv_from if self.hold_kv else math.inf)
        chunks = self._chunks
        if self.window_s is None:
            while chunks and self._first + CHUNK <= keep_from:
                chunks.pop(0)
                self._first += CHUNK
            return
        since = self._last_end - self.window_s
        while (len(chunks) > 1 and self._first + CHUNK <= keep_from
               and chunks[1]["end"][0] < since):
            chunks.pop(0)
            self._first += CHUNK
        for i, c in enumerate(chunks):
            if "sampled" in c and c["end"][-1] < since:
                chunks[i] = self._held(c, ("end",))

    def release_kv(self, row: int) -> None:
        """A cluster has merged the KV use of rows before `row` (with `hold_kv`)."""
        self._kv_from = max(self._kv_from, row)

    # --- reading --------------------------------------------------------------------------------
    def totals(self) -> Totals:
        """Totals of every row recorded (sealed and not)."""
        self.flush()
        t = Totals()
        t.add(self._tail, self._tail_n)
        return self.sealed.plus(t)

    def tail_itl(self, client: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """ITL gaps and token counts of the rows not yet sealed (see `itl` for the others);
        `client`: as the clients behind an API server see them (`client_itl`)."""
        self.flush()
        k = self._tail_n
        if client:
            return self._gaps(self._tail["out"][:k], self._tail["itl_count"][:k], self._last_out)
        return self._gaps(self._tail["end"][:k], self._tail["itl_count"][:k], self._last_end)

    def rows(self, name: str, lo: int, hi: int) -> np.ndarray:
        """Column `name` over rows [lo, hi) (absolute indices, clamped to those recorded).

        Raises EngineError when some of them were dropped (`keep=False`)."""
        self.flush()
        lo, hi = max(lo, 0), min(hi, self.n)
        if hi <= lo:
            return np.zeros(0, dtype=COLUMNS[name])
        pieces = []
        start = self._first
        for c in self._chunks:
            if start + CHUNK > lo and start < hi:
                if name not in c:
                    break
                pieces.append(c[name][max(lo - start, 0):min(hi - start, CHUNK)])
            start += CHUNK
        if lo < self._first or start < min(hi, self.sealed.rows):
            raise EngineError(f"timeline: rows {lo}..{hi} of {name!r} were folded into the "
                              "summary (a run that keeps no history)")
        if hi > start:
            pieces.append(self._tail[name][max(lo - start, 0):hi - start])
        v = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        v.flags.writeable = False
        return v

    def column(self, name: str) -> np.ndarray:
        """A read-only view of every recorded entry of a column.

        Raises EngineError when rows were dropped (`keep=False`)."""
        return self.rows(name, 0, self.n)

    def ends(self, start: int, count: int) -> np.ndarray:
        """End times of rows [start, start + count)."""
        return self.rows("end", start, start + count)

    def index(self, t: float, side: Literal["left", "right"] = "left") -> int:
        """Like `np.searchsorted(column("end"), t, side)` over the rows held."""
        self.flush()
        firsts = [float(c["end"][0]) for c in self._chunks]
        k = bisect.bisect_left(firsts, t) if side == "left" else bisect.bisect_right(firsts, t)
        # the row lies in chunk k - 1 (or in the tail when k == len(firsts))
        k = max(k - 1, 0)
        start = self._first + k * CHUNK
        for c in self._chunks[k:]:
            j = int(np.searchsorted(c["end"], t, side=side))
            if j < CHUNK:
                return start + j
            start += CHUNK
        return start + int(np.searchsorted(self._tail["end"][:self._tail_n], t, side=side))
