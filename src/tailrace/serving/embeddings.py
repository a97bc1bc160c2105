"""``POST /v1/embeddings`` over a served pipeline's embedding engine.

``model`` names a served pipeline with an ``embed`` stage, or an engine such a stage
uses (a pipeline of the same name wins); the texts go to that stage's engine, opened as
the stage opens it (the same shared engine or pool), not through the pipeline's stages.
docs/serving.md ("Embeddings") lists the fields.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

from ..api.pipeline import is_int
from ..compiler import Plan
from .openai_wire import WireError

#: most texts one embeddings request may carry (OpenAI's own limit).
MAX_INPUTS = 2048

#: request fields honoured; ``user`` is accepted and ignored by design.
FIELDS = ("model", "input", "encoding_format", "dimensions", "user")
ENCODINGS = ("float", "base64")


@dataclass(frozen=True)
class EmbeddingRequest:
    """A parsed ``/v1/embeddings`` request."""

    model: str
    texts: list[str]
    encoding_format: str
    dimensions: int | None


def parse_embeddings(body: dict) -> EmbeddingRequest:
    """Parse an embeddings request; raises ``WireError`` (400) naming the bad field."""
    unknown = [k for k in body if k not in FIELDS]
    if unknown:
        raise WireError(f"'{unknown[0]}' is not supported on /v1/embeddings (fields: "
                        f"{', '.join(FIELDS)})", code="unsupported_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise WireError("'model' is required: the name of a served pipeline with an embed "
                        "stage (GET /v1/models lists them)", code="missing_model")
    raw = body.get("input")
    texts: list[str]
    if isinstance(raw, str):
        texts = [raw]
    elif isinstance(raw, list) and raw and all(isinstance(t, str) for t in raw):
        texts = list(raw)
    elif isinstance(raw, list) and raw and (all(is_int(t) for t in raw) or all(
            isinstance(t, list) and all(is_int(x) for x in t) for t in raw)):
        raise WireError("'input': token-id arrays are not supported; send the text (a "
                        "string or a list of strings)", code="unsupported_input")
    else:
        raise WireError("'input' must be a string or a non-empty list of strings",
                        code="invalid_input")
    if len(texts) > MAX_INPUTS:
        raise WireError(f"'input' has {len(texts)} texts; at most {MAX_INPUTS} per request",
                        code="too_many_inputs")
    fmt = "float" if body.get("encoding_format") is None else body["encoding_format"]
    if fmt not in ENCODINGS:
        raise WireError(f"'encoding_format' must be 'float' or 'base64', got {fmt!r}",
                        code="invalid_encoding_format")
    dims = body.get("dimensions")
    if dims is not None and (not is_int(dims) or dims < 1):
        raise WireError(f"'dimensions' must be a positive integer, got {dims!r}",
                        code="invalid_dimensions")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise WireError(f"'user' must be a string, got {type(user).__name__}",
                        code="invalid_user")
    return EmbeddingRequest(model, texts, fmt, dims)


def embed_spec(plan: Plan) -> dict | None:
    """The linked engine spec of the plan's first ``embed`` stage, or None."""
    spec = next((o.params["_engine"] for s in plan.stages for o in s.ops
                 if o.op.name == "embed" and o.params.get("_engine")), None)
    return dict(spec) if spec is not None else None


def engine_specs(plans: list[Plan]) -> dict[str, dict]:
    """Every engine an ``embed`` stage of ``plans`` uses, by its name under ``engines:``
    (the first spec of a name wins: engines of one name are one shared engine)."""
    out: dict[str, dict] = {}
    for o in (o for plan in plans for s in plan.stages for o in s.ops):
        spec = o.params.get("_engine") if o.op.name == "embed" else None
        if spec and spec.get("_name") and spec["_name"] not in out:
            out[spec["_name"]] = dict(spec)
    return out


def _dim(engine: Any) -> int | None:
    try:
        d = getattr(engine, "dim", None)
    except Exception:  # noqa: BLE001 - a remote engine that cannot say yet
        return None
    return d if isinstance(d, int) and d > 0 else None


def _wrong_dims(req: EmbeddingRequest, dim: int) -> WireError:
    return WireError(f"'dimensions' is {req.dimensions}, but '{req.model}' embeds "
                     f"into {dim} dimensions; omit it or send {dim}",
                     code="unsupported_dimensions")


def embed_texts(spec: dict, req: EmbeddingRequest) -> tuple[Any, int]:
    """Embed ``req``'s texts with ``spec``'s engine: (float32 matrix, prompt tokens; the
    engine's tokenizer, else the shared estimate). Blocking: call it in a worker thread."""
    import numpy as np

    from ..engines import open_engine
    from ..engines.tokens import approx_tokens

    engine = open_engine(spec)
    dim = _dim(engine)
    if req.dimensions is not None and dim is not None and req.dimensions != dim:
        raise _wrong_dims(req, dim)
    vecs = np.asarray(engine.embed(req.texts), dtype=np.float32)
    if req.dimensions is not None and vecs.shape[1] != req.dimensions:
        raise _wrong_dims(req, int(vecs.shape[1]))
    count = getattr(engine, "count_tokens", None)
    tokens = sum(int(count(t)) if callable(count) else approx_tokens(t) for t in req.texts)
    return vecs, tokens


def embeddings_body(req: EmbeddingRequest, vecs: Any, tokens: int) -> dict[str, Any]:
    """The response object: one ``embedding`` per row of ``vecs``, in input order."""
    data = []
    for i, v in enumerate(vecs):
        emb: Any = (base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
                    if req.encoding_format == "base64" else v.tolist())
        data.append({"object": "embedding", "index": i, "embedding": emb})
    return {"object": "list", "data": data, "model": req.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
