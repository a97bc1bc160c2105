"""Model engines: generation and embedding backends, registered by name, loaded lazily."""

from .base import EmbeddingEngine, Generation, GenerationEngine, GenerationRequest, TokenCallback
from .registry import (
                   BACKENDS,
                   MODELS,
                   POOL_KEYS,
                   ModelInfo,
                   PoolHooks,
                   check_spec,
                   close_all,
                   home,
                   is_pool,
                   model_info,
                   model_path,
                   open_engine,
                   set_pool_hooks,
                   split_pool,
                   tokenizer_path,
)

__all__ = ["BACKENDS", "MODELS", "POOL_KEYS", "EmbeddingEngine", "Generation",
           "GenerationEngine", "GenerationRequest", "ModelInfo", "PoolHooks", "TokenCallback",
           "check_spec", "close_all", "home", "is_pool", "model_info", "model_path",
           "open_engine", "set_pool_hooks", "split_pool", "tokenizer_path"]
