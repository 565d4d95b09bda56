"""A pass's socket writes (`RawWriter`: one call; `PairWriter`: two threads): what each socket
took, in order."""

from __future__ import annotations

import socket

import pytest

from tui.serve.sender import PairWriter, RawWriter


@pytest.fixture(params=["pair", "raw"])
def writer(request):
    w = {"pair": PairWriter, "raw": RawWriter}[request.param]()
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
