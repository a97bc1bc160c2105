"""Pipeline API: builder, stage specs, YAML loader. Imports nothing heavy."""

from .pipeline import (
    CONTRACT_KEYS,
    BatchSpec,
    Contract,
    Pipeline,
    ServeSpec,
    StageSpec,
    Stream,
)
from .records import ErrorRecord

__all__ = ["CONTRACT_KEYS", "BatchSpec", "Contract", "ErrorRecord", "Pipeline", "ServeSpec",
           "StageSpec", "Stream"]
