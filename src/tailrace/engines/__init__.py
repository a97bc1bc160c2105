"""Model engines: generation and embedding backends, registered by name, loaded lazily."""

from .base import EmbeddingEngine, Generation, GenerationEngine, GenerationRequest, TokenCallback
from .models import BACKENDS, MODELS, ModelInfo, home, model_info, model_path, tokenizer_path
from .opener import POOL_KEYS, check_spec, close_all, is_pool, open_engine, split_pool, statistics

__all__ = ["BACKENDS", "MODELS", "POOL_KEYS", "EmbeddingEngine", "Generation",
           "GenerationEngine", "GenerationRequest", "ModelInfo", "TokenCallback",
           "check_spec", "close_all", "home", "is_pool", "model_info", "model_path",
           "open_engine", "split_pool", "statistics", "tokenizer_path"]
