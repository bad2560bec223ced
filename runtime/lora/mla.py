"""LoRA on multi-head latent attention (DeepSeek V2/V3, runtime/models/mla.py).

PEFT names MLA's projections q_proj (no q_lora_rank) or q_a_proj and q_b_proj,
kv_a_proj_with_mqa, kv_b_proj and o_proj. All but kv_b_proj see the step's tokens, so they take
the usual slot wrapper (layers.LoRALinear), with one twist: the loader permutes the rotary rows
of q and kv_a_proj_with_mqa from DeepSeek's interleaved pairs to rotate-half order, so an
adapter's B rows (the same output rows) are permuted the same way when its slot image is built.

kv_b_proj is different: it up-projects the latent cache, not the step's tokens. Prefill applies
it to a sequence's context latents (the sequence's adapter is the one of its query rows); decode
never applies it at all, but folds its weight into the query (W_UK) and into the attention output
(W_UV). An adapter's delta B A is folded in the same way, kept low rank:
    q_lat += ((q_nope @ B_UK) @ A)            per head, B_UK: B's K rows of that head
    o     += ((o_lat @ A^T) @ B_UV^T)          per head, B_UV: B's V rows of that head
so every place the weight is used sees W + B A, without materializing a per-adapter W.
"""

from __future__ import annotations

import torch

from kvserve.runtime.lora.layers import LoRALinear, LoRAState


def rope_row_perm(groups: int, group_size: int, rope_dim: int) -> torch.Tensor:
    """The loader's row order (models/mla._with_rope_rows_permuted) as an index into checkpoint
    rows: in each group of `group_size` rows, the last `rope_dim` go from interleaved pairs
    (x0, x1), (x2, x3), ... to (x0, x2, ..., x1, x3, ...)."""
    nope = group_size - rope_dim
    within = torch.cat((torch.arange(nope), nope + torch.arange(0, rope_dim, 2), nope + torch.arange(1, rope_dim, 2)))
    return (torch.arange(groups)[:, None] * group_size + within[None, :]).reshape(-1)


class PermutedLoRALinear(LoRALinear):
    """A slot wrapper whose base layer's output rows were permuted at load (`row_perm`, an index
    into the checkpoint's rows): B's rows follow them."""

    def __init__(self, base, state: LoRAState, *, row_perm: torch.Tensor, **kw) -> None:
        super().__init__(base, state, **kw)
        self.row_perm = row_perm

    def slot_image(self, rank, weights):
        weights = [None if ab is None else (ab[0], ab[1][self.row_perm]) for ab in weights]
        return super().slot_image(rank, weights)


class LatentLoRA(LoRALinear):
    """kv_b_proj's slots (A [L, C], B [C, this rank's heads x (nope + v)]) and the three places its
    delta is added. The base kv_b_proj stays where it is (the attention calls it directly and
    reads its raw weight for absorption); this object is not registered as a submodule, so the
    base weights are not listed twice."""

    def __init__(self, base, state: LoRAState, *, num_heads: int, nope: int, v_dim: int, **kw) -> None:
        super().__init__(base, state, parts=("kv_b_proj",), row_parallel=False, **kw)
        self.num_heads, self.nope, self.v_dim = num_heads, nope, v_dim

    def forward(self, x):  # never called: see the class docstring
        raise RuntimeError("kv_b_proj's LoRA is applied by the attention, not as a layer")

    def _ab(self, slot: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(A^T [L, r], B^T [r, H, nope + v]) of one slot, cut to its adapter's rank, in the
        activations' dtype (the slots may be kept narrower: lora_dtype)."""
        r = self.state.slot_ranks[slot]
        a_t, b_t = self.a_t[slot, :, :r].to(dtype), self.b_t[slot, :r].to(dtype)
        return a_t, b_t.view(r, self.num_heads, self.nope + self.v_dim)

    def decode_groups(self, rows: torch.Tensor, every: bool) -> list[tuple[int, torch.Tensor]]:
        """The decode rows' adapters: (slot, positions among the decode rows), none for the base."""
        batch = self.state.batch
        if batch is None:
            return []
        slots = batch.token_slots if every else [batch.token_slots[i] for i in rows.tolist()]
        by_slot: dict[int, list[int]] = {}
        for pos, slot in enumerate(slots):
            if slot >= 0:
                by_slot.setdefault(slot, []).append(pos)
        return [(s, torch.tensor(p, device=rows.device)) for s, p in by_slot.items()]

    def add_to_query(self, q_lat: torch.Tensor, q_nope: torch.Tensor, groups) -> torch.Tensor:
        """q_lat [n, H, L] + each row's q_nope [n, H, nope] through its adapter's K rows of B A."""
        if not groups:
            return q_lat
        q_lat = q_lat.clone()
        for slot, idx in groups:
            a_t, b_t = self._ab(slot, q_lat.dtype)
            u = torch.einsum("nhd,rhd->nhr", q_nope[idx], b_t[:, :, : self.nope])
            q_lat[idx] += u @ a_t.t()
        return q_lat

    def add_to_output(self, o: torch.Tensor, o_lat: torch.Tensor, groups) -> torch.Tensor:
        """o [n, H, v] + each row's o_lat [n, H, L] through its adapter's V rows of B A."""
        if not groups:
            return o
        o = o.clone()
        for slot, idx in groups:
            a_t, b_t = self._ab(slot, o.dtype)
            o[idx] += torch.einsum("nhr,rhd->nhd", o_lat[idx] @ a_t, b_t[:, :, self.nope:])
        return o

    def add_to_context(self, kv: torch.Tensor, ctx_c: torch.Tensor, first_row: int) -> torch.Tensor:
        """kv [seq_len, H * (nope + v)] of one prefill chunk's context, plus its sequence's adapter
        (the adapter of the chunk's first query row)."""
        batch = self.state.batch
        slot = -1 if batch is None else batch.token_slots[first_row]
        if slot < 0:
            return kv
        a_t, b_t = self._ab(slot, kv.dtype)
        return kv + (ctx_c @ a_t) @ b_t.reshape(b_t.shape[0], -1)


def wrap_mla(attn, state: LoRAState, *, max_loras: int, max_rank: int, rope_interleave: bool,
             dtype: torch.dtype | None = None) -> list[LoRALinear]:
    """Wraps an MLAAttention's projections in place; returns the wrappers (kv_b_proj's included)."""
    kw = dict(max_loras=max_loras, max_rank=max_rank, dtype=dtype)
    qk = attn.nope + attn.rope
    heads = attn.q_proj.spec.output_sizes[0] // qk

    def column(base, name: str, groups: int, group_size: int) -> LoRALinear:
        if not rope_interleave:
            return LoRALinear(base, state, parts=(name,), row_parallel=False, **kw)
        return PermutedLoRALinear(base, state, parts=(name,), row_parallel=False,
                                  row_perm=rope_row_perm(groups, group_size, attn.rope), **kw)

    wrapped: list[LoRALinear] = []
    if attn.q_a_proj is not None:
        attn.q_a_proj = LoRALinear(attn.q_a_proj, state, parts=("q_a_proj",), row_parallel=False, **kw)
        wrapped.append(attn.q_a_proj)
    attn.q_proj = column(attn.q_proj, "q_proj" if attn.q_a_proj is None else "q_b_proj", heads, qk)
    latent = attn.kv_lora_rank + attn.rope
    attn.kv_a_proj_with_mqa = column(attn.kv_a_proj_with_mqa, "kv_a_proj_with_mqa", 1, latent)
    attn.o_proj = LoRALinear(attn.o_proj, state, parts=("o_proj",), row_parallel=True, **kw)
    kv_b = LatentLoRA(attn.kv_b_proj, state, num_heads=attn.num_heads, nope=attn.nope, v_dim=attn.v_dim, **kw)
    object.__setattr__(attn, "kv_b_lora", kv_b)
    wrapped += [attn.q_proj, attn.kv_a_proj_with_mqa, attn.o_proj, kv_b]
    return wrapped
