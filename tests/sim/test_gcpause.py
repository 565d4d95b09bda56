"""The collector pause: short blocks (a dashboard frame, a server turn) leave garbage cycles
collectable; long runs freeze what they made."""

import gc
import weakref

from sim import gcpause


class Node:
    pass


def _cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_garbage_made_between_short_paused_blocks_is_still_collected():
    gc.collect()
    refs = []
    for _ in range(50):
        refs.append(_cycle())  # garbage made while the collector runs, as a server's turn does
        with gcpause.paused_gc():
            pass
    gc.collect()
    assert all(r() is None for r in refs)


def test_a_long_block_freezes_what_exists(monkeypatch):
    monkeypatch.setattr(gcpause, "FREEZE_AFTER_S", 0.0)
    gc.collect()
    before = gc.get_freeze_count()
    try:
        with gcpause.paused_gc():
            keep = [Node() for _ in range(100)]
        assert gc.get_freeze_count() >= before + 100
    finally:
        gc.unfreeze()
    del keep


def test_a_block_done_once_per_command_freezes_however_short():
    """Reading a log and checking a replay freeze what they made (their records would otherwise
    all be scanned by the first collection after them); other short blocks do not."""
    gc.collect()
    before = gc.get_freeze_count()
    try:
        with gcpause.paused_gc():
            short = [Node() for _ in range(100)]
        assert gc.get_freeze_count() < before + 100
        with gcpause.paused_gc(freeze=True):
            once = [Node() for _ in range(100)]
        assert gc.get_freeze_count() >= before + 200
    finally:
        gc.unfreeze()
    del short, once
