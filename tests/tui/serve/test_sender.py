"""A pass's socket writes (`RawWriter`: one call, C or Python; `PairWriter`: two threads):
what each socket took, in order."""

from __future__ import annotations

import socket

import pytest

from sim import _compiled
from tui.serve import sender
from tui.serve.sender import PairWriter, RawWriter

C_SEND = _compiled.c_module("tui.serve._send")


class PyRawWriter(RawWriter):
    """RawWriter through the Python stand-in of the C loop."""

    def write_all(self, fds, datas, times=None):
        sent, stamps = sender.write_many_py(fds, datas, times is not None)
        if times is not None:
            times[:] = stamps
        return sent


@pytest.fixture(params=["pair", "raw", "raw-python"])
def writer(request):
    if request.param == "raw" and sender.write_many is sender.write_many_py:
        pytest.skip("the C send loop is not built (pure Python install)")
    w = {"pair": PairWriter, "raw": RawWriter, "raw-python": PyRawWriter}[request.param]()
    yield w
    w.close()


def pairs(n: int):
    out = []
    for _ in range(n):
        a, b = socket.socketpair()
        a.setblocking(False)
        out.append((a, b))
    return out


def read_all(sock) -> bytes:
    sock.setblocking(False)
    data = b""
    while True:
        try:
            got = sock.recv(1 << 16)
        except BlockingIOError:
            return data
        if not got:
            return data
        data += got


@pytest.mark.parametrize("n", [3, 40])  # one thread, and both
def test_every_socket_gets_its_own_bytes(writer, n):
    socks = pairs(n)
    datas = [f"frame {i} ".encode() * (i + 1) for i in range(n)]
    times: list[float] = []
    sent = writer.write_all([a.fileno() for a, _ in socks], datas, times)
    assert sent == [len(d) for d in datas]
    assert [read_all(b) for _, b in socks] == datas
    assert len(times) == n and all(t > 0 for t in times)
    for a, b in socks:
        a.close()
        b.close()


def test_a_full_socket_takes_part_and_a_closed_one_reports_an_error(writer):
    socks = pairs(40)
    full, gone = socks[7][0], socks[30]
    full.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    gone[1].close()
    big = bytes(range(256)) * 4096  # 1 MiB: more than the socket takes at once
    datas = [b"x%d" % i for i in range(40)]
    datas[7] = big
    sent = writer.write_all([a.fileno() for a, _ in socks], datas)
    assert 0 < sent[7] < len(big)
    assert read_all(socks[7][1]) == big[:sent[7]]  # the part it took, the rest is the caller's
    assert sent[30] == -1
    assert [s for i, s in enumerate(sent) if i not in (7, 30)] == [
        len(d) for i, d in enumerate(datas) if i not in (7, 30)]
    for a, b in socks:
        a.close()
        if b is not gone[1]:
            b.close()


@pytest.mark.skipif(C_SEND is None, reason="the C send loop is not built")
@pytest.mark.parametrize("args", [
    (), ([1], [b"x"]), ((1,), [b"x"], False), ([1], [b"x", b"y"], False), (["1"], [b"x"], False),
    ([1], ["x"], False), ([-1], [b"x"], False), ([1 << 40], [b"x"], False), ([1.0], [b"x"], False),
    ([True], [b"x"], False), ([1], [bytearray(b"x")], False), ([1], [b"x"], False, None),
])
def test_the_c_loop_rejects_bad_arguments_with_an_exception(args):
    with pytest.raises((TypeError, ValueError, OverflowError)):
        C_SEND.write_many(*args)


@pytest.mark.skipif(C_SEND is None, reason="the C send loop is not built")
def test_an_edited_c_source_is_not_used(monkeypatch):
    """The send loop is used only while its source is what was built (and not under
    SERVESIM_PURE=1): an edit, until the next install, runs the Python stand-in."""
    assert _compiled.c_module("tui.serve._send") is C_SEND
    monkeypatch.setattr(_compiled, "source_digest", lambda path: "edited")
    assert _compiled.c_module("tui.serve._send") is None
    monkeypatch.undo()
    monkeypatch.setenv("SERVESIM_PURE", "1")
    assert _compiled.c_module("tui.serve._send") is None
