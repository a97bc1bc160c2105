"""``POST /v1/embeddings`` with the real ONNX embedder (minilm-l6-int8) on a live server,
through the official ``openai`` client; and what ``GET /v1/models`` says each pipeline
accepts."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest

import tailrace as tr
from tailrace.serving import PipelineService, ServingHub
from tests.rag_fixtures import EMBEDDER
from tests.serving import fakes
from tests.serving.server import running

pytestmark = pytest.mark.engine

KEY = "test-key"
H = {"Authorization": f"Bearer {KEY}"}
TEXTS = ["Paris is the capital of France.", "A man is playing a guitar.", "short"]


def embed_pipeline() -> tr.Pipeline:
    p = tr.Pipeline("emb", engines={"embedder": EMBEDDER})
    (p.source(fields=["text"])
     .apply("embed", id="embed", engine="embedder", input="text", output="vec").sink())
    return p


@pytest.fixture(scope="module")
def server():
    """emb (a real embed stage), echo (generate over EchoEngine) and shout (a map), one
    server for the module, API key set."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("tokenizers")
    with pytest.MonkeyPatch.context() as mp:
        fakes.register_echo(mp)
        hub = ServingHub([PipelineService(embed_pipeline()), PipelineService(fakes.echo_pipeline()),
                          PipelineService(fakes.shout_pipeline())], api_key=KEY)
        with running(hub) as url:
            yield url


def client(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def stage_vector(url: str, text: str) -> np.ndarray:
    """What the pipeline's own embed stage computes for ``text``."""
    r = httpx.post(url + "/v1/pipelines/emb/runs", json={"text": text}, headers=H)
    assert r.status_code == 200, r.text
    return np.asarray(r.json()["vec"], dtype=np.float32)


def test_one_string_as_floats_equals_the_embed_stage(server):
    r = client(server).embeddings.create(model="emb", input=TEXTS[0], encoding_format="float")
    assert r.object == "list" and r.model == "emb" and len(r.data) == 1
    d = r.data[0]
    assert d.object == "embedding" and d.index == 0 and len(d.embedding) == 384
    np.testing.assert_allclose(d.embedding, stage_vector(server, TEXTS[0]), atol=1e-6)
    assert r.usage.prompt_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens


def test_a_list_in_order_with_usage(server):
    r = client(server).embeddings.create(model="emb", input=TEXTS, encoding_format="float",
                                         user="someone")
    assert [d.index for d in r.data] == [0, 1, 2]
    for d, text in zip(r.data, TEXTS, strict=True):
        np.testing.assert_allclose(d.embedding, stage_vector(server, text), atol=1e-6)
    one = client(server).embeddings.create(model="emb", input=TEXTS[2],
                                           encoding_format="float")
    assert r.usage.prompt_tokens > one.usage.prompt_tokens > 0


def test_base64_is_little_endian_float32_of_the_same_vectors(server):
    h = {**H, "Content-Type": "application/json"}
    floats = httpx.post(server + "/v1/embeddings", headers=h, json={
        "model": "emb", "input": TEXTS, "encoding_format": "float"}).json()
    r = httpx.post(server + "/v1/embeddings", headers=h, json={
        "model": "emb", "input": TEXTS, "encoding_format": "base64"})
    assert r.status_code == 200, r.text
    for b64, flt in zip(r.json()["data"], floats["data"], strict=True):
        vec = np.frombuffer(base64.b64decode(b64["embedding"]), dtype="<f4")
        assert vec.shape == (384,)
        np.testing.assert_array_equal(vec, np.asarray(flt["embedding"], dtype=np.float32))
    # the openai client asks for base64 by default and decodes it itself
    default = client(server).embeddings.create(model="emb", input=TEXTS[1])
    np.testing.assert_allclose(default.data[0].embedding, floats["data"][1]["embedding"],
                               atol=1e-7)


def test_matching_dimensions_is_accepted(server):
    r = client(server).embeddings.create(model="emb", input="x", dimensions=384,
                                         encoding_format="float")
    assert len(r.data[0].embedding) == 384


@pytest.mark.parametrize("extra,field,code", [
    ({"input": [[101, 2023, 102]]}, "'input'", "unsupported_input"),
    ({"input": [101, 2023, 102]}, "'input'", "unsupported_input"),
    ({"input": "x", "dimensions": 128}, "'dimensions'", "unsupported_dimensions"),
    ({"input": "x", "truncate": True}, "'truncate'", "unsupported_parameter"),
    ({"input": "x", "encoding_format": "int8"}, "'encoding_format'",
     "invalid_encoding_format"),
    ({"input": []}, "'input'", "invalid_input"),
], ids=["token-arrays", "token-ids", "dimensions", "unknown-field", "encoding", "empty"])
def test_400_naming_the_field(server, extra, field, code):
    r = httpx.post(server + "/v1/embeddings", headers=H, json={"model": "emb", **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert field in err["message"] and err["code"] == code
    assert err["type"] == "invalid_request_error"


def test_400_with_the_openai_client_for_a_wrong_dimension(server):
    with pytest.raises(openai.BadRequestError, match="384") as ei:
        client(server).embeddings.create(model="emb", input="x", dimensions=3)
    assert ei.value.status_code == 400


def test_an_engine_by_its_name_embeds_as_its_pipeline_stage(server):
    by_engine = client(server).embeddings.create(model="embedder", input=TEXTS,
                                                 encoding_format="float")
    by_pipe = client(server).embeddings.create(model="emb", input=TEXTS,
                                               encoding_format="float")
    assert by_engine.model == "embedder" and len(by_engine.data) == 3
    for a, b in zip(by_engine.data, by_pipe.data, strict=True):
        np.testing.assert_array_equal(np.asarray(a.embedding), np.asarray(b.embedding))
    with pytest.raises(openai.BadRequestError, match="'embedder' embeds into 384"):
        client(server).embeddings.create(model="embedder", input="x", dimensions=3)


def test_too_many_inputs(server):
    r = httpx.post(server + "/v1/embeddings", headers=H,
                   json={"model": "emb", "input": ["a"] * 2049})
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_inputs"


def test_pipeline_without_an_embed_stage(server):
    with pytest.raises(openai.BadRequestError) as ei:
        client(server).embeddings.create(model="shout", input="x")
    err = ei.value.body
    assert err["code"] == "pipeline_not_embedding" and "'shout'" in err["message"]
    r = httpx.post(server + "/v1/embeddings", headers=H, json={"model": "nope", "input": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_401_without_the_key(server):
    r = httpx.post(server + "/v1/embeddings", json={"model": "emb", "input": "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"
    with pytest.raises(openai.AuthenticationError):
        client(server, key="wrong").embeddings.create(model="emb", input="x")


def test_models_say_what_each_pipeline_accepts(server):
    models = {m.id: m for m in client(server).models.list()}
    assert list(models) == ["emb", "echo", "shout", "embedder"]
    assert models["emb"].object == "model" and models["emb"].owned_by == "tailrace"
    meta = {k: m.model_extra["metadata"] for k, m in models.items()}
    assert meta["emb"].pop("not_chat").startswith("pipeline 'emb' has no generate")
    assert meta["emb"] == {"endpoints": ["embeddings", "pipelines.runs"],
                           "input_field": "text"}
    assert meta["echo"] == {"endpoints": ["chat.completions", "completions", "responses",
                                          "pipelines.runs"],
                            "input_field": "question", "max_tokens": 8,
                            "answering_stage": {"id": "answer", "kind": "generate"},
                            "options": ["max_tokens", "temperature", "top_p", "stop", "seed",
                                        "presence_penalty", "frequency_penalty"],
                            "frozen": [], "tools": False, "conversation": True,
                            "generate_max_tokens": {"answer": 8}}
    assert meta["embedder"] == {"endpoints": ["embeddings"], "engine": "minilm-l6-int8"}
    assert "no generate, route or tool_call" in meta["shout"].pop("not_chat")
    assert meta["shout"] == {"endpoints": ["pipelines.runs"], "input_field": "text"}
