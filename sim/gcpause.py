"""A context manager that pauses Python's cyclic garbage collector.

Runs, log writes and replays allocate hundreds of thousands of small objects (requests, events,
records) and create no reference cycles among them; the collector's repeated passes over every
live object would only cost time (about a quarter of a long run). On the way out of a long block
the objects made meanwhile are frozen (`gc.freeze`) rather than scanned once more: they are still
freed by reference counting when dropped, but never walked by the collector again.

Short blocks (a live dashboard's frame, a server's turn: many a second) never freeze: freezing
also moves every cycle of garbage made since the last collection (asyncio's, aiohttp's) out of
the collector's reach for good, which in a process that runs for days is a leak.
"""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager

FREEZE_AFTER_S = 1.0  # a block at least this long freezes what it made


@contextmanager
def paused_gc(freeze: bool = False):
    """`freeze=True` freezes on the way out however short the block: for work done once per
    command (reading a session log, checking a replay), whose objects would otherwise all be
    scanned by the first collection after it."""
    was_on = gc.isenabled()
    gc.disable()
    t0 = time.perf_counter()
    try:
        yield
    finally:
        if was_on:
            if freeze or time.perf_counter() - t0 >= FREEZE_AFTER_S:
                gc.freeze()
            gc.enable()


def freeze_survivors() -> None:
    """Collect, then freeze what is left: for what a long-running process made at start-up
    and keeps for good (a server's modules, engine and scenario), so that no later collection
    scans it. Garbage is collected first, so nothing that should go is frozen."""
    gc.collect()
    gc.freeze()


def collect_frozen() -> None:
    """Collect what a long block froze and has since been dropped. Runs are meant to leave no
    reference cycle (tests drop each kind of engine and deployment with the collector off), but
    one that did would be out of the collector's reach for good once frozen: a process that runs
    one scenario after another (a sweep's worker, `validate`) calls this after each, so such a
    cycle costs one run's memory, not the process's. Nothing is done when nothing was frozen."""
    if gc.get_freeze_count():
        gc.unfreeze()
        gc.collect()
