"""Medusa's candidate tree (vLLM's ``speculative_token_tree``, Medusa's ``medusa_choices``): its
layout, its candidates, its acceptance.

Pure functions; the forward pass that scores a tree is ``kvserve.kernels.tree_attention``.

A choice is a path of top-k ranks, one per head: ``(0,)`` is head 0's best guess, ``(1,)`` its
second, ``(0, 2)`` head 1's third guess placed after head 0's best. Node 0 is the root, the
sequence's pending token (the target's last output, not yet in the cache); nodes 1..T are the
choices sorted by depth, so every parent comes before its children. One target forward over the
T + 1 nodes, each attending to the context and to its own ancestors only, gives every node the
target's next token after the path that ends there; the longest path whose tokens the target
would have produced itself is accepted, plus the target's token after it (the bonus), exactly
what greedy decoding produces: a chain is the tree with choices ``(0,), (0, 0), (0, 0, 0), ...``.

Ancestor sets are int64 bitmasks (bit j: node j is visible), so a tree has at most 64 nodes
(root included): Medusa's largest published tree has 63 choices.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MAX_TREE_NODES = 64


@dataclass(frozen=True)
class TreeLayout:
    """`parents[i]` (-1 for the root), `depths[i]` (0 for the root), `ranks[i]` (top-k rank of node
    i at head depths[i] - 1; -1 for the root), `masks[i]` (int64 bitmask of node i and its
    ancestors), `children[i]` (node ids)."""

    choices: tuple[tuple[int, ...], ...]
    parents: tuple[int, ...]
    depths: tuple[int, ...]
    ranks: tuple[int, ...]
    masks: tuple[int, ...]
    children: tuple[tuple[int, ...], ...]

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @property
    def depth(self) -> int:
        """Heads the tree uses (its longest path)."""
        return max(self.depths)

    def top_k(self, head: int) -> int:
        """How many guesses of `head` the tree places somewhere."""
        return 1 + max((r for r, d in zip(self.ranks, self.depths) if d == head + 1), default=-1)


def parse_choices(value, *, num_heads: int | None = None) -> tuple[tuple[int, ...], ...]:
    """Validated choices (a list of non-empty lists of ranks >= 0, every prefix present, no
    duplicates, at most 63), sorted by depth then path. Errors name ``speculative_token_tree``."""
    key = "speculative_config.speculative_token_tree"
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{key}: expected a non-empty list of paths (lists of top-k ranks), got {value!r}")
    paths = []
    for path in value:
        if (not isinstance(path, (list, tuple)) or not path
                or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in path)):
            raise ValueError(f"{key}: each path must be a non-empty list of ranks >= 0, got {path!r}")
        paths.append(tuple(path))
    if len(set(paths)) != len(paths):
        raise ValueError(f"{key}: a path appears twice")
    if len(paths) >= MAX_TREE_NODES:
        raise ValueError(f"{key}: at most {MAX_TREE_NODES - 1} paths, got {len(paths)}")
    known = set(paths)
    for path in paths:
        if len(path) > 1 and path[:-1] not in known:
            raise ValueError(f"{key}: {list(path)} needs its parent path {list(path[:-1])} in the tree too")
    if num_heads is not None and max(len(p) for p in paths) > num_heads:
        raise ValueError(f"{key}: a path of {max(len(p) for p in paths)} ranks needs that many heads; "
                         f"the Medusa directory has {num_heads}")
    return tuple(sorted(paths, key=lambda p: (len(p), p)))


def chain_choices(k: int) -> tuple[tuple[int, ...], ...]:
    """The chain of k top-1 guesses as a tree."""
    return tuple((0,) * d for d in range(1, k + 1))


def tree_layout(choices: Sequence[Sequence[int]]) -> TreeLayout:
    choices = parse_choices(list(choices))
    index = {(): 0}
    parents, depths, ranks, masks = [-1], [0], [-1], [1]
    children: list[list[int]] = [[]]
    for path in choices:
        node = len(parents)
        parent = index[path[:-1]]
        index[path] = node
        parents.append(parent)
        depths.append(len(path))
        ranks.append(path[-1])
        masks.append(masks[parent] | (1 << node))
        children.append([])
        children[parent].append(node)
    # Bit 63 set makes a Python int past int64's range: store the two's complement value.
    masks = [m - (1 << 64) if m >= 1 << 63 else m for m in masks]
    return TreeLayout(choices, tuple(parents), tuple(depths), tuple(ranks), tuple(masks),
                      tuple(tuple(c) for c in children))


def candidate_tokens(layout: TreeLayout, root_token: int, top: Sequence[Sequence[int]]) -> list[int]:
    """Each node's token: the root's is the pending token, node i's is head depths[i] - 1's guess of
    rank ranks[i] (`top[h]` lists head h's guesses, best first, at least layout.top_k(h) of them)."""
    return [root_token] + [int(top[d - 1][r]) for d, r in zip(layout.depths[1:], layout.ranks[1:])]


def positions(layout: TreeLayout, start: int) -> list[int]:
    """Each node's position in the sequence (the root's is `start`): its depth past the root."""
    return [start + d for d in layout.depths]


def accept(layout: TreeLayout, tokens: Sequence[int], target: Sequence[int]) -> tuple[list[int], list[int]]:
    """Greedy acceptance: (accepted node ids from the root on, emitted tokens). `target[i]` is the
    target's greedy token after node i's path; a child is accepted when its token is the one the
    target gives after its parent. The emitted tokens are the accepted children's tokens plus the
    target's token after the last accepted node (so always at least one)."""
    path = [0]
    out = []
    node = 0
    while True:
        want = int(target[node])
        nxt = next((c for c in layout.children[node] if tokens[c] == want), None)
        out.append(want)
        if nxt is None:
            return path, out
        path.append(nxt)
        node = nxt
