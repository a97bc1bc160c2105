"""``tailrace serve``: bad input is a one-line error (exit 2); a real server process
answers, checks its API key (``/metrics`` open with ``--metrics-public``) and admission,
and drains on Ctrl-C."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx

from tailrace.cli.main import main
from tests.serving.conftest import ROOT


def test_bad_yaml_is_one_line_and_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\npipeline: x\nstages:\n  - {id: a, op: nope}\n")
    assert main(["serve", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tailrace: error: ") and "nope" in err[0]


def test_missing_api_key_variable_and_busy_port(pipe, capsys, monkeypatch):
    monkeypatch.delenv("TAILRACE_TEST_KEY", raising=False)
    assert main(["serve", str(pipe), "--api-key-env", "TAILRACE_TEST_KEY"]) == 2
    assert capsys.readouterr().err.strip() == (
        "tailrace: error: --api-key-env TAILRACE_TEST_KEY: that environment variable is "
        "not set or empty (it should hold the API key)")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert main(["serve", str(pipe), "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"tailrace: error: cannot listen on 127.0.0.1:{port}: ")
    assert err.endswith("pick another --port (0 picks a free one)")
    assert main(["serve", str(pipe), "--max-in-flight", "0"]) == 2
    assert "--max-in-flight must be >= 1, got 0" in capsys.readouterr().err


def test_serve_process_answers_then_drains_on_ctrl_c(pipe):
    env = {**os.environ, "TAILRACE_TEST_KEY": "k1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tailrace.cli.main", "serve", str(pipe), "--port", "0",
         "--api-key-env", "TAILRACE_TEST_KEY", "--metrics-public", "--admission", "fcfs"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("tailrace: serving loud on http://127.0.0.1:"), line
        base = line.split(" on ")[1].split()[0]  # http://127.0.0.1:PORT/v1
        root = base.removesuffix("/v1")
        deadline = time.monotonic() + 30
        while httpx.get(root + "/readyz").status_code != 200:
            assert time.monotonic() < deadline, "never ready"
            time.sleep(0.05)
        h = {"Authorization": "Bearer k1"}
        r = httpx.post(base + "/pipelines/loud/runs", json={"text": "hey"}, headers=h)
        assert r.status_code == 200 and r.json() == {"text": "hey", "loud": "HEY"}
        assert httpx.get(base + "/models").status_code == 401
        assert httpx.get(base + "/models", headers=h).json()["data"][0]["id"] == "loud"
        assert httpx.get(root + "/metrics").status_code == 200  # --metrics-public
        assert httpx.get(root + "/dashboard/data").status_code == 401
        assert httpx.get(root + "/dashboard/data", headers=h).status_code == 200
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "Traceback" not in err and err.strip().endswith("tailrace: stopped (interrupted)")


def test_listening_socket_is_tcp_so_responses_are_not_delayed():
    from tailrace.cli.serve import _listen

    sock = _listen("127.0.0.1", 0)  # asyncio sets TCP_NODELAY only on IPPROTO_TCP sockets
    try:
        assert sock.proto == socket.IPPROTO_TCP
    finally:
        sock.close()


def test_sigterm_drains_like_ctrl_c_while_serving_and_its_handler_is_restored_after():
    import pytest

    from tailrace.cli.serve import _sigterm_interrupts

    def before(signum, frame):
        raise AssertionError("the previous handler ran inside")

    old = signal.signal(signal.SIGTERM, before)
    try:
        with pytest.raises(KeyboardInterrupt), _sigterm_interrupts():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises at the next bytecode: never reached
        assert signal.getsignal(signal.SIGTERM) is before  # restored, also on the way out
        with _sigterm_interrupts():
            pass
        assert signal.getsignal(signal.SIGTERM) is before
    finally:
        signal.signal(signal.SIGTERM, old)
