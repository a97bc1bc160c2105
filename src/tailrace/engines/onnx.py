"""Sentence embeddings with onnxruntime and a HuggingFace ``tokenizers`` tokenizer.

Texts are tokenized once (truncated to ``max_length``), sorted by token length and run
in batches padded to the longest text of each batch, so short texts never pay for long
ones; rows come back in input order, mean-pooled over the attention mask and
L2-normalised. onnxruntime, tokenizers and numpy are imported when an engine is created.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from ..errors import EngineError
from .models import MODELS, model_info, model_path, tokenizer_path

#: output names that already hold one pooled vector per text (sentence-transformers).
_POOLED = ("sentence_embedding", "sentence_embeddings")


class OnnxEmbedder:
    """An ``EmbeddingEngine`` running a BERT-style ONNX encoder on the CPU."""

    def __init__(self, model: str = "minilm-l6-int8", *, path: str | None = None,
                 tokenizer: str | None = None, batch_size: int = 64, max_length: int = 256,
                 n_threads: int | None = None) -> None:
        """Load the model and its tokenizer.

        model:      a catalog name (``minilm-l6-int8``, ``minilm-l3``), or a label with ``path``.
        path:       an ONNX file to load instead of the catalog model's.
        tokenizer:  a ``tokenizer.json`` to use instead of the catalog model's.
        batch_size: texts per onnxruntime call.
        max_length: tokens per text (special tokens included); longer texts are truncated.
        n_threads:  onnxruntime intra-op threads (default: ``os.cpu_count()``).
        """
        if batch_size < 1:
            raise EngineError(f"onnx embedder: batch_size must be >= 1, got {batch_size}")
        if max_length < 2:
            raise EngineError(f"onnx embedder: max_length must be >= 2, got {max_length}")
        info = None
        if path is not None and tokenizer is not None:
            model_file, tok_file = path, tokenizer
        else:
            if path is not None and model not in MODELS:
                raise EngineError(f"onnx embedder '{model}': with 'path:' also give "
                                  "'tokenizer:' (a tokenizer.json file)")
            info = model_info(model, "onnx")  # EngineError listing the known models
            model_file = path or str(model_path(info))
            tok_file = tokenizer or str(tokenizer_path(info))
        try:
            import numpy as np
            import onnxruntime as ort
            from tokenizers import Tokenizer
        except ImportError as e:
            raise EngineError(f"the onnx backend needs numpy, onnxruntime and tokenizers "
                              f"({e}); install them with: pip install onnxruntime "
                              "tokenizers numpy") from None
        self._np = np
        self.model = model
        self.batch_size = batch_size
        self.max_length = max_length

        try:
            self._tok = Tokenizer.from_file(tok_file)
            self._count_tok = Tokenizer.from_file(tok_file)
        except Exception as e:
            raise EngineError(f"cannot load tokenizer {tok_file}: {e}") from None
        pad = self._tok.padding or {}
        self._pad_id = int(pad.get("pad_id", self._tok.token_to_id("[PAD]") or 0))
        # tokenizer.json pins fixed padding and truncation at 128: we truncate to
        # max_length and pad each batch ourselves to its longest text.
        self._tok.no_padding()
        self._tok.enable_truncation(max_length)
        self._count_tok.no_padding()
        self._count_tok.no_truncation()

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = n_threads or os.cpu_count() or 1
        opts.inter_op_num_threads = 1
        try:
            self._session: Any = ort.InferenceSession(model_file, sess_options=opts,
                                                 providers=["CPUExecutionProvider"])
        except Exception as e:
            raise EngineError(f"cannot load ONNX model {model_file}: {e}") from None
        self._inputs = {i.name: (np.int32 if "int32" in i.type else np.int64)
                        for i in self._session.get_inputs()}
        if "input_ids" not in self._inputs:
            raise EngineError(f"ONNX model {model_file} has no 'input_ids' input (it has: "
                              f"{', '.join(self._inputs)})")
        self._output, self._pooled = self._pick_output(model_file)
        self.dim = self._probe_dim(info.dim if info else 0)

    def _pick_output(self, model_file: str) -> tuple[str, bool]:
        """The output to read, and whether it is already pooled: a ``sentence_embedding``
        output as is, else the float 3-D token embeddings, mean-pooled here (minilm-l3's
        unnamed 2-D pooled output is skipped: pooling here matches it to 1e-7)."""
        outputs = [o for o in self._session.get_outputs() if "float" in o.type]
        for o in outputs:
            if o.name in _POOLED and len(o.shape) == 2:
                return o.name, True
        for o in outputs:
            if len(o.shape) == 3:  # (batch, tokens, hidden): token embeddings
                return o.name, False
        raise EngineError(f"ONNX model {model_file} has no float token-embedding output "
                          f"(outputs: {', '.join(o.name for o in self._session.get_outputs())})")

    def _probe_dim(self, catalog_dim: int) -> int:
        shape = next(o.shape for o in self._session.get_outputs() if o.name == self._output)
        if isinstance(shape[-1], int) and shape[-1] > 0:
            return shape[-1]
        return catalog_dim or int(self._run([self._tok.encode("dimension probe")]).shape[1])

    def count_tokens(self, text: str) -> int:
        """Tokens ``text`` takes, special tokens included, before truncation."""
        return len(self._count_tok.encode(text).ids)

    def embed(self, texts: Sequence[str]) -> Any:
        """A float32 ``(len(texts), dim)`` matrix of unit-norm rows, in input order (each
        text truncated to ``max_length`` tokens)."""
        np = self._np
        if isinstance(texts, str):
            raise EngineError("embed() takes a list of texts, not one string")
        texts = list(texts)
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        if not texts:
            return out
        encodings = self._tok.encode_batch(texts)
        order = sorted(range(len(texts)), key=lambda i: len(encodings[i].ids))
        for start in range(0, len(order), self.batch_size):
            idx = order[start:start + self.batch_size]
            out[idx] = self._run([encodings[i] for i in idx])
        return out

    def _run(self, encodings: list[Any]) -> Any:
        """Pooled, normalised embeddings of one batch of encodings."""
        np = self._np
        width = max(len(e.ids) for e in encodings)
        ids = np.full((len(encodings), width), self._pad_id, dtype=np.int64)
        mask = np.zeros((len(encodings), width), dtype=np.int64)
        types = np.zeros((len(encodings), width), dtype=np.int64)
        for row, enc in enumerate(encodings):
            n = len(enc.ids)
            ids[row, :n] = enc.ids
            mask[row, :n] = 1
            types[row, :n] = enc.type_ids
        given = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
        feed = {name: given[name].astype(dtype, copy=False)
                for name, dtype in self._inputs.items() if name in given}
        missing = set(self._inputs) - set(feed)
        if missing:
            raise EngineError(f"ONNX model needs inputs this engine cannot supply: "
                              f"{', '.join(sorted(missing))}")
        session = self._session
        if session is None:
            raise EngineError(f"embedding engine '{self.model}' is closed")
        try:
            (hidden,) = session.run([self._output], feed)
        except Exception as e:
            raise EngineError(f"onnxruntime failed on a batch of {len(encodings)}: {e}") from None
        hidden = hidden.astype(np.float32, copy=False)
        if self._pooled:
            vecs = hidden
        else:
            m = mask[:, :, None].astype(np.float32)
            vecs = (hidden * m).sum(axis=1) / np.maximum(m.sum(axis=1), 1e-9)
        norms = np.linalg.norm(vecs, axis=1, keepdims=True)
        return (vecs / np.maximum(norms, 1e-12)).astype(np.float32, copy=False)

    def close(self) -> None:
        """Free the onnxruntime session; later ``embed`` calls raise EngineError."""
        self._session = None

    def __repr__(self) -> str:
        return f"OnnxEmbedder(model={self.model!r}, dim={self.dim})"
