"""`servesim serve` on the command line: what it refuses is one line and exit code 2."""

from __future__ import annotations

import socket

import pytest

from tui.cli import main


@pytest.mark.parametrize("argv, words", [
    (["--speed", "0"], "--speed 0"),
    (["--speed", "1e8"], "would pass its limit of 1e+09 s within a day of serving; at most 11574"),
    (["--set", "cluster.replicas=2"], "one engine instance"),
    (["--policy", "disaggregated"], "invalid choice"),
    (["--port", "70000"], "--port 70000"),
    (["--max-waiting", "-1"], "--max-waiting -1"),
    (["--keep-alive-timeout", "0"], "--keep-alive-timeout 0: must be a positive number"),
    (["--body-timeout", "nan"], "--body-timeout nan: must be a positive number"),
    (["--max-connections", "0"], "--max-connections 0: must be at least 1"),
    (["--log", "/no/such/dir/s.msgpack"], "--log /no/such/dir/s.msgpack: directory"),
    (["no-such-scenario"], "no-such-scenario"),
])
def test_bad_arguments_are_one_line_and_exit_2(capsys, argv, words):
    try:
        code = main(["serve", *argv])
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and "Traceback" not in err


def test_a_port_in_use_is_one_line_and_exit_2(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"--port {port}: cannot listen" in err and "Traceback" not in err
