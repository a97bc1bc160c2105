"""Who is asking: a pipeline's ``serve:`` block maps the request (``user``, ``metadata``,
headers) to record fields, so a memory pipeline remembers across requests; API keys map
to tenants whose field the caller cannot choose, with per-tenant limits (429). Real
uvicorn on loopback, the ``openai`` client, real SQLite memory, an echo generate engine."""

from __future__ import annotations

import json
import os

import httpx
import openai
import pytest

import tailrace as tr
from tailrace.api.yaml_loader import load_pipeline, loads_pipeline
from tailrace.cli.main import main
from tailrace.errors import PlanError
from tailrace.serving import PipelineService, ServingHub
from tailrace.serving.tenants import Tenant, TenantKeys
from tests.serving import fakes
from tests.serving.server import running

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEY_A, KEY_B, KEY_SLOW, ADMIN = "sk-alpha-000000", "sk-beta-1111111", "sk-slow-22222", "sk-adm-3333"

# chat-with-memory without retrieval: the session's turns, then an echo "model" that
# says back the memory and the question (so the answer shows what was recalled)
CHAT = """\
version: 1
pipeline: chat
source: {{fields: [question, user_id, session_id]}}
serve:
  fields: {{user_id: user, session_id: "header:X-Session-Id"}}
  tenant: user_id
engines:
  llm: {{backend: echo, model: echo, path: {fakes}}}
stages:
  - {{id: recall, op: memory_read, store: {{backend: sqlite, path: {db}}}, user: user_id,
     session: session_id, turns: 4, output: memory}}
  - {{id: answer, op: generate, engine: llm, prompt: "{{memory}} Q: {{question}}",
     output: answer, max_tokens: 200}}
  - {{id: remember, op: memory_write, store: {{backend: sqlite, path: {db}}}, user: user_id,
     session: session_id, turns: {{user: question, assistant: answer}}}}
"""


@pytest.fixture
def chat_yaml(tmp_path, monkeypatch):
    fakes.register_echo(monkeypatch)
    path = tmp_path / "chat.yaml"
    path.write_text(CHAT.format(fakes=fakes.__file__, db=tmp_path / "memory.sqlite"))
    return str(path)


def hub_of(path: str, **kw) -> ServingHub:
    return ServingHub([PipelineService(load_pipeline(path))], **kw)


def ask(url: str, key: str, text: str, *, user: str | None = None, session: str = "s1"
        ) -> str:
    c = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
    extra = {"user": user} if user is not None else {}
    r = c.chat.completions.create(model="chat", messages=[{"role": "user", "content": text}],
                                  extra_headers={"X-Session-Id": session}, **extra)
    return r.choices[0].message.content or ""


def test_a_fact_told_in_one_request_is_recalled_in_the_next(chat_yaml):
    with running(hub_of(chat_yaml)) as url:
        ask(url, "none", "my favourite colour is teal", user="ada")
        assert "teal" in ask(url, "none", "what is my favourite colour?", user="ada")
        # the memory is that user's session: another session or user sees nothing
        assert "teal" not in ask(url, "none", "my colour?", user="ada", session="s2")
        assert "teal" not in ask(url, "none", "my colour?", user="bob")
        # completions map the same fields; /runs takes the header too
        r = httpx.post(url + "/v1/pipelines/chat/runs", headers={"X-Session-Id": "s1"},
                       json={"question": "and?", "user_id": "ada"})
        assert "teal" in r.json()["memory"]


def test_a_tenant_cannot_read_another_tenants_memory(chat_yaml):
    keys = TenantKeys({KEY_A: Tenant("alpha"), KEY_B: Tenant("beta")})
    with running(hub_of(chat_yaml, tenants=keys)) as url:
        ask(url, KEY_B, "the vault code is 777", user="beta")
        ask(url, KEY_A, "alpha likes mangoes", user="beta")  # written as alpha, not beta
        assert "777" in ask(url, KEY_B, "the code?")
        # alpha claims to be beta in every way it can: `user`, the body, both
        for user in ("beta", None):
            answer = ask(url, KEY_A, "the code?", user=user)
            assert "777" not in answer and "mangoes" in answer
        r = httpx.post(url + "/v1/pipelines/chat/runs",
                       headers={"Authorization": f"Bearer {KEY_A}", "X-Session-Id": "s1"},
                       json={"question": "code?", "user_id": "beta", "user": "beta"})
        assert r.status_code == 200
        out = r.json()
        assert out["user_id"] == "alpha" and "777" not in out["memory"]
        assert "mangoes" in out["memory"]
        # and no key, or a wrong one, is refused
        r = httpx.post(url + "/v1/pipelines/chat/runs", json={"question": "q"})
        assert (r.status_code, r.json()["error"]["code"]) == (401, "missing_api_key")
        with pytest.raises(openai.AuthenticationError):
            ask(url, "sk-nobody-00000", "q")


def test_per_tenant_limits_give_429_with_retry_after(tmp_path):
    p = tr.Pipeline("shout", serve={"tenant": "who"})
    p.source(fields=["text"]).map(fakes.shout, id="shout").sink()
    keys = TenantKeys({KEY_SLOW: Tenant("slow", requests_per_s=0.2),
                       KEY_A: Tenant("alpha", tokens_per_min=6),
                       KEY_B: Tenant("beta")})
    hub = ServingHub([PipelineService(p)], tenants=keys, api_key=ADMIN)

    def run(key: str, text: str = "hi") -> httpx.Response:
        return httpx.post(url + "/v1/pipelines/shout/runs", json={"text": text, "who": "x"},
                          headers={"Authorization": f"Bearer {key}"})

    with running(hub) as url:
        first = run(KEY_SLOW)
        assert first.status_code == 200 and first.json()["who"] == "slow"
        r = run(KEY_SLOW)
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
        assert r.json()["error"]["type"] == "rate_limit_error"
        assert 1 <= int(r.headers["Retry-After"]) <= 5
        # tokens/min: the record's text is reserved; a long one is over the budget
        assert run(KEY_A).status_code == 200
        r = run(KEY_A, "word " * 40)
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        # other tenants are not held back; the --api-key-env key has no tenant
        assert all(run(KEY_B).status_code == 200 for _ in range(5))
        admin = run(ADMIN)
        assert admin.status_code == 200 and admin.json()["who"] == "x"


def test_serve_fields_from_metadata_and_headers_overwrite_the_body():
    p = tr.Pipeline("shout", serve={"fields": {"team": "metadata.team",
                                               "trace": "header:X-Trace"}})
    p.source(fields=["text"]).map(fakes.shout, id="shout").sink()
    with running(ServingHub([PipelineService(p)])) as url:
        r = httpx.post(url + "/v1/pipelines/shout/runs", headers={"X-Trace": "t-1"},
                       json={"text": "hi", "trace": "mine", "metadata": {"team": "red"}})
        assert r.json()["trace"] == "t-1" and r.json()["team"] == "red"
        r = httpx.post(url + "/v1/pipelines/shout/runs", json={"text": "hi", "trace": "mine"})
        assert r.json()["trace"] == "mine" and "team" not in r.json()  # no source: untouched
        r = httpx.post(url + "/v1/pipelines/shout/runs",
                       json={"text": "hi", "metadata": {"team": 3}})
        assert r.status_code == 400 and "metadata.team" in r.json()["error"]["message"]


@pytest.mark.parametrize("content, needle", [
    ("[1, 2]", "expected a mapping"),
    ('{"sk-good-key-1": {"tenant": "a"}, "sk-bad-key-2": {"tenant": "b", '
     '"requests_per_s": -1}}', "entry 2 (tenant 'b'): 'requests_per_s' must be a positive"),
    ('{"sk-good-key-1": {"tenat": "a"}}', "entry 1: 'tenant' must be a non-empty string"),
])
def test_a_bad_keys_file_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch, content,
                                                needle):
    monkeypatch.chdir(ROOT)
    pipe = tmp_path / "p.yaml"
    pipe.write_text("version: 1\npipeline: p\nsource: {fields: [text]}\nstages:\n"
                    "  - {id: up, op: map, fn: tests.fixtures.ops.upper, input: text, "
                    "output: loud}\n")
    keys = tmp_path / "keys.json"
    keys.write_text(content)
    assert main(["serve", str(pipe), "--keys-file", str(keys), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"tailrace: error: --keys-file {keys}")
    assert needle in err[0] and "sk-" not in err[0]  # names the entry, never the key


@pytest.mark.parametrize("serve, line, needle", [
    ("serve: {fields: {user_id: user}, tennant: user_id}", 3, "unknown key 'serve.tennant'"),
    ("serve:\n  tenant: user_id\n  fields:\n    user_id: cookie:sid", 6,
     "source 'cookie:sid' is not one of user, metadata.KEY or header:NAME"),
    ("serve: {tenant: 3}", 3, "'serve.tenant' must name a record field"),
])
def test_a_bad_serve_block_is_a_plan_error_at_its_line(serve, line, needle):
    text = f"version: 1\npipeline: x\n{serve}\nstages:\n  - {{id: a, op: map}}\n"
    with pytest.raises(PlanError) as ei:
        loads_pipeline(text, "p.yaml")
    assert f"p.yaml:{line}" in str(ei.value) and needle in str(ei.value)
    with pytest.raises(PlanError, match="serve.fields.u"):
        tr.Pipeline("x", serve={"fields": {"u": "body"}})


def test_the_example_declares_its_serve_block():
    p = load_pipeline(os.path.join(ROOT, "examples", "chat-with-memory.yaml"))
    assert p.serve is not None and p.serve.tenant == "user_id"
    assert dict(p.serve.fields) == {"user_id": "user", "session_id": "header:X-Session-Id",
                                    "remember": "metadata.remember"}
    assert json.dumps(dict(p.serve.fields))  # plain strings


@pytest.mark.engine
@pytest.mark.slow
def test_the_example_served_with_keys_keeps_tenants_apart(tailrace_home, tmp_path,
                                                          monkeypatch):
    """examples/chat-with-memory.yaml itself (llama.cpp, ONNX embedder, the wiki slice),
    served with a keys file, on a fresh SQLite memory store."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "indexes").symlink_to(tailrace_home / "indexes")
    monkeypatch.setenv("TAILRACE_HOME", str(home))
    keys = TenantKeys({KEY_A: Tenant("ada"), KEY_B: Tenant("bob")})
    hub = hub_of(os.path.join(ROOT, "examples", "chat-with-memory.yaml"), tenants=keys)
    fact = "Ada is writing an essay about the film 2001: A Space Odyssey."
    with running(hub) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key=KEY_A, max_retries=0)
        r = c.chat.completions.create(
            model="chat-with-memory", user="bob", extra_headers={"X-Session-Id": "s1"},
            messages=[{"role": "user", "content": "Who directed 2001: A Space Odyssey?"}],
            extra_body={"metadata": {"remember": fact}})
        assert r.choices[0].message.content

        def runs(key: str, body: dict) -> dict:
            r = httpx.post(url + "/v1/pipelines/chat-with-memory/runs", json=body,
                           headers={"Authorization": f"Bearer {key}", "X-Session-Id": "s1"},
                           timeout=120)
            assert r.status_code == 200, r.text
            return r.json()

        q = {"question": "In which year was that film released?", "user_id": "ada",
             "session_id": "s1"}
        mine = runs(KEY_A, q)
        assert mine["user_id"] == "ada" and fact in mine["memory"]
        assert "user: Who directed 2001: A Space Odyssey?" in mine["memory"]
        theirs = runs(KEY_B, q)  # bob asks as ada, in ada's session: nothing of hers
        assert theirs["user_id"] == "bob" and theirs["memory"] == ""


def test_tenant_keys_never_open_the_operators_pages():
    # with --keys-file and no operator key, /metrics and /dashboard stay closed: a tenant
    # must not read the other tenants' traffic there
    from tailrace.serving.security import KeyCheck

    closed = KeyCheck(None, operator_only=True)
    h = {"authorization": "Bearer tenant-key-a"}
    assert closed.metrics(h).code == "operator_key_required"
    refused, cookie = closed.dashboard(h, {}, "tenant-key-a")
    assert refused.status == 401 and refused.code == "operator_key_required" and not cookie
    assert KeyCheck(None, operator_only=True, metrics_public=True).metrics(h) is None
    with_operator = KeyCheck("operator-key", operator_only=True)
    assert with_operator.metrics({"authorization": "Bearer operator-key"}) is None
    assert with_operator.metrics(h).code == "invalid_api_key"
