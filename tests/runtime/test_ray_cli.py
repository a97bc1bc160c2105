"""``tailrace run --runtime ray [--address ADDR]``: same output and stats format as the
local runtime, and a one-line error (exit 2) when Ray is missing or unreachable."""

import json
import os
import socket
import subprocess
import sys

import pytest

from tailrace.cli.main import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PIPE = """\
version: 1
pipeline: cli
source: {fields: [text]}
stages:
  - {id: up, op: map, fn: tests.fixtures.ops.upper, input: text, output: loud}
  - {id: size, op: map, fn: tests.fixtures.ops.n_chars, input: loud, output: n, replicas: 2}
"""


@pytest.fixture
def files(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    pipe = tmp_path / "p.yaml"
    pipe.write_text(PIPE)
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"text": "x" * i}) + "\n" for i in range(50)))
    return pipe, inp, tmp_path


def run_cli(runtime, pipe, inp, tmp):
    out, metrics = tmp / f"{runtime}.jsonl", tmp / f"{runtime}.json"
    rc = main(["run", str(pipe), "--input", str(inp), "--output", str(out),
               "--metrics-json", str(metrics), "--runtime", runtime])
    return rc, [json.loads(x) for x in out.read_text().splitlines()], \
        json.loads(metrics.read_text())


def test_run_on_ray_matches_local(files, capsys, ray_session):
    pipe, inp, tmp = files
    rc, local_out, local_m = run_cli("local", pipe, inp, tmp)
    assert rc == 0
    rc, ray_out, ray_m = run_cli("ray", pipe, inp, tmp)
    assert rc == 0
    key = lambda r: r["text"]  # noqa: E731 - two replicas: order may differ
    assert sorted(ray_out, key=key) == sorted(local_out, key=key)
    assert len(ray_out) == 50
    assert (ray_m["records_in"], ray_m["records_out"], ray_m["errors"]) == (50, 50, 0)
    assert [s["stage"] for s in ray_m["stages"]] == [s["stage"] for s in local_m["stages"]]
    assert set(local_m) <= set(ray_m) and set(local_m["stages"][1]) <= set(ray_m["stages"][1])
    assert "50 in, 50 out, 0 errors" in capsys.readouterr().err


def test_runtime_ray_without_ray_installed_is_a_one_line_error(files, capsys, monkeypatch):
    pipe, inp, _ = files
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    assert main(["run", str(pipe), "-i", str(inp), "--runtime", "ray"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tailrace: error: --runtime ray needs the 'ray' package (")
    assert err.rstrip().endswith("install it with pip install 'tailrace[ray]' (ray>=2.30), "
                                 "or use --runtime local")
    assert len(err.strip().splitlines()) == 1


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_address_is_a_one_line_error_within_seconds(files):
    pipe, inp, _ = files
    port = free_port()  # closed again: nothing listens there
    proc = subprocess.run(
        [sys.executable, "-m", "tailrace.cli.main", "run", str(pipe), "-i", str(inp),
         "--runtime", "ray", "--address", f"127.0.0.1:{port}"],
        capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"tailrace: error: cannot reach the Ray cluster at 127.0.0.1:{port}: Connection "
        "refused; start one with `ray start --head` or check --address")
    assert proc.stdout == ""


@pytest.mark.parametrize("argv, message", [
    (["--address", "127.0.0.1:6379"], "--address names a Ray cluster: add --runtime ray"),
    (["--runtime", "ray", "--address", "nonsense"],
     "--address 'nonsense' is not a Ray cluster address; give HOST:PORT (e.g. "
     "127.0.0.1:6379), ray://HOST:PORT or auto"),
])
def test_bad_address_arguments(files, capsys, argv, message):
    pipe, inp, _ = files
    assert main(["run", str(pipe), "-i", str(inp), *argv]) == 2
    assert capsys.readouterr().err.strip() == f"tailrace: error: {message}"


def test_docs_commands_run(files, capsys, ray_session):
    """docs/ray.md: its first Python snippet and its first command work as shown."""
    with open(os.path.join(ROOT, "docs", "ray.md")) as f:
        text = f.read()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(code, "docs/ray.md", "exec"), {})
    assert capsys.readouterr().out.startswith("[0, 2, 4, 6, 8, 10, 12, 14, 16, 18] (")
    _, _, tmp = files
    out = tmp / "stats.jsonl"
    assert main(["run", "examples/text-stats.yaml", "--input", "examples/sample.jsonl",
                 "--runtime", "ray", "--output", str(out)]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == [1, 2, 3, 4, 5, 6]
    assert "6 in, 6 out, 0 errors" in capsys.readouterr().err


def test_joining_a_cluster_presents_the_local_auth_token(tmp_path, monkeypatch):
    """``ray start --head`` turns token auth on and saves the token; a client given an
    address sends it only with RAY_AUTH_MODE=token, which connect sets when a token is
    at hand and the mode was not chosen."""
    from tailrace.runtime.ray.connect import use_local_token

    for var in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert not use_local_token() and "RAY_AUTH_MODE" not in os.environ  # no token here
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("x" * 64)
    assert use_local_token() and os.environ["RAY_AUTH_MODE"] == "token"
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # the user's choice stands
    assert not use_local_token() and os.environ["RAY_AUTH_MODE"] == "disabled"
    monkeypatch.delenv("RAY_AUTH_MODE")
    monkeypatch.setenv("HOME", str(tmp_path / "nowhere"))
    monkeypatch.setenv("RAY_AUTH_TOKEN", "y" * 64)
    assert use_local_token() and os.environ["RAY_AUTH_MODE"] == "token"
