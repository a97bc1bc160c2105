"""Tree-structured advantages: credit for individual routing decisions, read off the
search trees (docs/routing.md, "Training a router").

At a node where both decisions were tried, each child's value (the best reward of the
paths below it) is what that decision led to with everything before it held fixed, so
``Q(large) - Q(small)`` is a counterfactual advantage of that one decision; a decision
with no explored alternative carries no credit. Each such node becomes one training
example: its features, the better decision, and the size of the difference as weight.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .tree import Node, Tree


@dataclass(frozen=True)
class Example:
    """One decision point with both choices explored."""

    features: Any
    large: bool  # the decision that led to the higher value
    weight: float  # |Q(large) - Q(small)|
    advantage: float  # Q(large) - Q(small)


def branch_nodes(node: Node) -> Iterator[Node]:
    """The nodes under ``node`` (itself included) with both decisions explored."""
    stack = [node]
    while stack:
        n = stack.pop()
        if len(n.children) == 2:
            yield n
        stack.extend(n.children.values())


def advantage(node: Node) -> float:
    """``Q(large) - Q(small)`` at a node with both children."""
    return node.children[True].value - node.children[False].value


def examples(trees: Sequence[Tree], min_weight: float = 1e-9) -> list[Example]:
    """The training examples of every branch node of ``trees`` whose two decisions'
    values differ by more than ``min_weight``."""
    out = []
    for tree in trees:
        for n in branch_nodes(tree.root):
            a = advantage(n)
            if abs(a) > min_weight and n.features is not None:
                out.append(Example(n.features, a > 0, abs(a), a))
    return out
