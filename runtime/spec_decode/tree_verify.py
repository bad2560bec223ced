"""Medusa tree verification inside a batched step (``speculative_token_tree``).

A sequence verified as a tree runs its root (the pending token) and its T candidate nodes as
1 + T rows, written in node order to the slots start..start+T but placed at positions
start + depth, each attending to its context and its own ancestors only
(AttentionMetadata.tree_masks). After acceptance the accepted path's K/V is moved to the slots
start..start+m where the sequence continues (``path_moves``), on rank 0 at once and on the other
ranks before their next step (ForwardInput.kv_slot_moves); the slots past the path are then
rolled back like rejected chain drafts, so the rejected branches' blocks go back to the pool.

The scheduler may cut a sequence's drafts short; since nodes are sorted by depth, any prefix of
them is a tree of its own (``Tree.layout(n)``). A prefix that is a chain runs as a chain (decode
rows on the CPU), and so do sampled requests under rejection sampling and requests with structured
outputs (their drafts are the tree's top-1 chain): only greedy requests, and sampled ones under
typical acceptance, use branches.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvserve.runtime.spec_decode.medusa_tree import TreeLayout, accept, tree_layout
from kvserve.runtime.spec_decode.typical import acceptable


class Tree:
    def __init__(self, choices: Sequence[Sequence[int]]) -> None:
        self.full = tree_layout(choices)
        self.choices = self.full.choices
        self._layouts = {self.full.num_nodes: self.full}  # prefixes, built as the scheduler cuts them
        # Nodes of the top-1 chain, root first: (), (0,), (0, 0), ... as far as the tree has them.
        index = {c: n for n, c in enumerate(self.choices, 1)}
        chain = [0]
        while (0,) * len(chain) in index:
            chain.append(index[(0,) * len(chain)])
        self.chain = tuple(chain)
        # How many guesses of each head the tree places (top-k per head).
        self.top_k = tuple(self.full.top_k(h) for h in range(self.full.depth))

    def layout(self, num_nodes: int) -> TreeLayout:
        """The tree of its first `num_nodes` nodes (root included)."""
        got = self._layouts.get(num_nodes)
        if got is None:
            got = self._layouts[num_nodes] = tree_layout(self.choices[:num_nodes - 1])
        return got

    def is_chain(self, num_nodes: int) -> bool:
        return self.chain[:num_nodes] == tuple(range(num_nodes))

    def nodes_within(self, depth: int) -> int:
        """Nodes (root included) of depth <= `depth`: a prefix, since nodes are sorted by depth."""
        return sum(1 for d in self.full.depths if d <= depth)

    def candidates(self, top: Sequence[Sequence[int]]) -> list[int]:
        """The T non-root nodes' tokens from each head's guesses (`top[h]`, best first)."""
        return [int(top[d - 1][r]) for d, r in zip(self.full.depths[1:], self.full.ranks[1:])]

    def chain_tokens(self, candidates: Sequence[int]) -> list[int]:
        return [candidates[n - 1] for n in self.chain[1:]]


def unsupported(model_config, backend: str | None, kv_cache_dtype: torch.dtype | None) -> str | None:
    """Why this target cannot verify trees, or None. None today: both attention backends take
    trees with sliding windows, soft-capping, ALiBi and fp8 KV caches, and multi-head latent
    attention verifies them in its up-projected (prefill) path. Kept as the one place a new
    attention path without tree masks says so at start."""
    del model_config, backend, kv_cache_dtype
    return None


def top_guesses(heads, hidden: torch.Tensor, top_k: Sequence[int]) -> list[list[list[int]]]:
    """[rows][head][rank] target token ids: each head's `top_k[h]` best guesses."""
    logits = heads(hidden, len(top_k))  # [rows, heads, vocab]
    best = logits.topk(max(top_k), dim=-1).indices
    if heads.token_map is not None:
        best = heads.token_map[best]
    return [[row[h][:k] for h, k in enumerate(top_k)] for row in best.tolist()]


def greedy_path(layout: TreeLayout, tokens: Sequence[int], target_argmax: Sequence[int]) -> tuple[list[int], list[int]]:
    """(accepted nodes from the root on, emitted tokens): exactly what greedy decoding gives."""
    return accept(layout, tokens, target_argmax)


def typical_path(layout: TreeLayout, tokens: Sequence[int], probs: torch.Tensor, threshold: float, alpha: float,
                 generator: torch.Generator | None = None) -> tuple[list[int], list[int]]:
    """Typical acceptance over a tree: node c passes when its token passes the test under its
    parent's distribution (probs[parent]); the longest path of passing nodes from the root is
    accepted (ties: the better-ranked branch), then one token is drawn from the target's
    distribution after its last node."""
    n = layout.num_nodes
    parents = layout.parents
    ok = [True] + acceptable(probs[list(parents[1:])], tokens[1:], threshold, alpha)
    # Longest passing path below each node, children before parents (nodes are depth-sorted).
    best = [0] * n
    nxt = [-1] * n
    for node in range(n - 1, -1, -1):
        for child in layout.children[node]:
            if ok[child] and best[child] + 1 > best[node]:
                best[node], nxt[node] = best[child] + 1, child
    path = [0]
    while nxt[path[-1]] >= 0:
        path.append(nxt[path[-1]])
    bonus = int(torch.multinomial(probs[path[-1]].float(), 1, generator=generator).item())
    return path, [tokens[c] for c in path[1:]] + [bonus]


def path_moves(path: Sequence[int], start: int, table: Sequence[int], block_size: int) -> list[tuple[int, int]]:
    """(source slot, destination slot) pairs that bring the accepted path's K/V (node path[j] at
    slot start + path[j]) to the slots start + j. Each destination lies below every later source,
    so the pairs may be applied in order, or all read before any is written."""
    out = []
    for j, node in enumerate(path):
        if node != j:
            src, dst = start + node, start + j
            out.append((table[src // block_size] * block_size + src % block_size,
                        table[dst // block_size] * block_size + dst % block_size))
    return out


def move_slots(kv_caches, moves: Sequence[tuple[int, int]]) -> None:
    """Copies cache slots (every layer's pools; float8 pools as their bytes)."""
    if not moves:
        return
    from kvserve.runtime.kv_cache import as_storage

    device = kv_caches[0][0].device
    src = torch.tensor([s for s, _ in moves], dtype=torch.long, device=device)
    dst = torch.tensor([d for _, d in moves], dtype=torch.long, device=device)
    for layer in kv_caches:
        for pool in layer:
            flat = as_storage(pool).flatten(0, 1)
            flat.index_copy_(0, dst, flat.index_select(0, src))
