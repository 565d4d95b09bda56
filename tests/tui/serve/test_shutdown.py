"""`servesim serve` stopped by a signal with streams open: each stream ends as vLLM's do on
shutdown (an `abort` frame, then `[DONE]`), the process exits at once with 128 + the signal,
and with `--log FILE` the session log it writes replays exactly."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

from sim.session.log import read_log
from tui.cli import main

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_ends_open_streams_with_abort_and_done_and_exits(sig, tmp_path, capsys):
    log = tmp_path / "session.msgpack"
    # (SIGHUP's default restored: the suite may run under nohup, whose ignored SIGHUP a server
    # rightly leaves alone)
    proc = subprocess.Popen([sys.executable, "-m", "tui.cli", "serve", "--port", "0",
                             "--log", str(log)], cwd=ROOT,
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    try:
        banner = proc.stderr.readline()
        url = re.search(r"(http://\S+)/v1", banner).group(1)
        streams: list[list[bytes]] = [[], []]
        first = [threading.Event(), threading.Event()]

        def read(i: int) -> None:
            body = json.dumps({"model": "llama-3.1-8b", "prompt": "hi", "max_tokens": 20000,
                               "stream": True}).encode()
            req = urllib.request.Request(url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                for line in r:
                    if line.strip():
                        streams[i].append(line.strip())
                        first[i].set()

        readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in (0, 1)]
        for t in readers:
            t.start()
        assert all(e.wait(60) for e in first)  # (hang guards, not timings)
        proc.send_signal(sig)
        assert proc.wait(30) == 128 + sig
        for t in readers:
            t.join(30)
        for lines in streams:
            assert lines[-1] == b"data: [DONE]"
            assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "abort"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert [e.action for e in read_log(log).events if e.kind == "action"] == ["inject"] * 2
    assert [p.name for p in tmp_path.iterdir()] == [log.name]  # (no temporary file left)
    assert main(["replay", "--verify", str(log), "-q"]) == 0, capsys.readouterr().err
