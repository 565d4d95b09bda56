"""The engine's step timeline: one row per engine step, kept in growable NumPy columns.

Token times are not stored per token: a request records runs of consecutive steps in which it
received a token, and each token's time is its step's end time here. That keeps a 4-million-token
trace to a few hundred thousand rows and lets pooled ITL percentiles be computed with weights.
Single rows are staged in a Python list and written to the columns in bulk, since a NumPy write
per row would cost more than the step it records.
"""

from __future__ import annotations

import numpy as np

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
}
NAMES = tuple(COLUMNS)


class Timeline:
    """Append-only columns, one entry per engine step."""

    def __init__(self, capacity: int = 4096) -> None:
        self._n = 0
        self._rows: list[tuple] = []
        self._cols = {k: np.zeros(capacity, dtype=t) for k, t in COLUMNS.items()}

    @property
    def n(self) -> int:
        """Number of steps recorded."""
        return self._n + len(self._rows)

    def _grow(self, need: int) -> None:
        cap = len(self._cols["end"])
        if self._n + need <= cap:
            return
        new_cap = max(cap * 2, self._n + need)
        for k, col in self._cols.items():
            grown = np.zeros(new_cap, dtype=col.dtype)
            grown[: self._n] = col[: self._n]
            self._cols[k] = grown

    def _flush(self) -> None:
        rows = self._rows
        if not rows:
            return
        k = len(rows)
        self._grow(k)
        i = self._n
        for name, values in zip(NAMES, zip(*rows)):
            self._cols[name][i:i + k] = values
        self._n += k
        self._rows = []

    def add_row(self, *row) -> None:
        """Append one step; values in the order of COLUMNS."""
        self._rows.append(row)

    def append(self, **cols) -> int:
        """Append k rows (every column a scalar or an array of length k).

        Returns the index of the first new row.
        """
        self._flush()
        k = len(cols["end"])
        self._grow(k)
        i = self._n
        for name, col in self._cols.items():
            col[i:i + k] = cols.get(name, 0)
        self._n += k
        return i

    def column(self, name: str) -> np.ndarray:
        """A read-only view of every recorded entry of a column."""
        self._flush()
        v = self._cols[name][: self._n]
        v.flags.writeable = False
        return v

    def end_times(self) -> np.ndarray:
        return self.column("end")
