"""A live session's events kept on disk as they are made, so that its memory stays bounded however
long it runs and its session log can still be written whole.

`Spool(engine)` holds one temporary file per event stream (the engine's, or a deployment's own
and each instance's). `trim()` moves each stream's events but its latest `keep` from the
engine's lists to its file, as the records a session log stores; the engine appends and
extends only the latest events (a run of decode steps grows its last `steps` event), so what
moves is final. `records()` gives every record in the order a session log stores them (the
file's, then those still in memory, each stream opened as `log_events` opens it), and
`write_log(..., records=spool.records())` writes the session. The files are unnamed
(`tempfile.TemporaryFile`: removed by the system when closed or when the process ends, however
it ends).
"""

from __future__ import annotations

import tempfile

import msgpack

from sim.engine import events as ev
from sim.errors import LogError
from sim.session.log import encode

KEEP = 1024  # events left in memory per stream: the latest, which the engine may still extend


class Spool:
    def __init__(self, engine, keep: int = KEEP, dir: str | None = None) -> None:
        self.engine = engine
        self.keep = max(1, keep)
        self.dir = dir
        self._files: dict = {}  # stream -> its temporary file
        self.spooled: dict = {}  # stream -> events moved to its file
        self.bytes = 0  # on disk, all streams
        self._packer = msgpack.Packer(use_bin_type=True)

    def _streams(self):
        """(stream, the engine's list of its events): one stream (None) for a single engine."""
        tagged = getattr(self.engine, "tagged_events", None)
        return tagged() if tagged is not None else [(None, self.engine.events)]

    def trim(self, keep: int = 0) -> dict:
        """Move all but the latest `keep` events (at least the spool's `keep`; more where
        a reader has yet to see them) of each stream to its file. Returns how many
        moved, per stream (the engine's lists are shorter by that much at their start; the
        totals are in `spooled`). Raises LogError when a file cannot be written (that stream's
        events stay in memory then)."""
        moved = {}
        for stream, events in self._streams():
            n = len(events) - max(self.keep, keep)
            if n <= 0:
                continue
            pack = self._packer.pack
            body = b"".join([pack(encode(e)) for e in events[:n]])
            fh = self._files.get(stream)
            at = fh.seek(0, 2) if fh is not None else 0
            try:
                if fh is None:
                    fh = self._files[stream] = tempfile.TemporaryFile(
                        prefix="servesim-spool-", dir=self.dir, buffering=0)
                view = memoryview(body)
                while view:
                    view = view[fh.write(view):]
            except OSError as e:
                if fh is not None:  # (a cut record must not stay before the next ones)
                    fh.truncate(at)
                raise LogError(f"the session's event spool ({self.dir or tempfile.gettempdir()})"
                               f": cannot write: {e.strerror or e}") from None
            del events[:n]
            self.spooled[stream] = self.spooled.get(stream, 0) + n
            self.bytes += len(body)
            moved[stream] = n
        return moved

    def _spooled_records(self, stream):
        fh = self._files.get(stream)
        if fh is None:
            return
        fh.seek(0)
        up = msgpack.Unpacker(fh, raw=False, strict_map_key=False, max_buffer_size=0)
        yield from up

    def records(self):
        """Every record of the session so far, in a session log's order, as it stores them."""
        tagged = getattr(self.engine, "log_events", None)
        if tagged is None:
            yield from self._spooled_records(None)
            yield from map(encode, self.engine.events)
            return
        for e in tagged():
            yield encode(e)
            if type(e) is ev.Stream:  # (its stream's spooled events come first)
                yield from self._spooled_records(e.instance)

    def close(self) -> None:
        for fh in self._files.values():
            fh.close()
        self._files.clear()
