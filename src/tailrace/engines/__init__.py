"""Model engines: generation and embedding backends, registered by name, loaded lazily."""

from .base import EmbeddingEngine, Generation, GenerationEngine, GenerationRequest, TokenCallback
from .registry import (
                   BACKENDS,
                   MODELS,
                   ModelInfo,
                   check_spec,
                   close_all,
                   home,
                   model_info,
                   model_path,
                   open_engine,
                   tokenizer_path,
)

__all__ = ["BACKENDS", "MODELS", "EmbeddingEngine", "Generation", "GenerationEngine",
           "GenerationRequest", "ModelInfo", "TokenCallback", "check_spec", "close_all", "home",
           "model_info", "model_path", "open_engine", "tokenizer_path"]
