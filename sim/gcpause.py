"""A context manager that pauses Python's cyclic garbage collector.

Runs, log writes and replays allocate hundreds of thousands of small objects (requests, events,
records) and create no reference cycles among them; the collector's repeated passes over every
live object would only cost time (about a quarter of a long run). On the way out the objects
made meanwhile are frozen (`gc.freeze`) rather than scanned once more: they are still freed by
reference counting when dropped, but never walked by the collector again.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager


@contextmanager
def paused_gc():
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.freeze()
            gc.enable()
