"""Built-in operators and the registry that maps YAML ``op:`` names to them."""

from . import check, core, llm, memory, retrieval, route, semantic, tools  # noqa: F401  (built-ins)
from .custom import Operator
from .registry import (
    BuildContext,
    OpDef,
    OpRuntime,
    Param,
    known_ops,
    lookup,
    qualname,
    register,
    resolve,
)

__all__ = ["BuildContext", "OpDef", "OpRuntime", "Operator", "Param", "known_ops", "lookup",
           "qualname", "register", "resolve"]
