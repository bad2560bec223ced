"""Hidden states for speculative heads at pipeline_parallel_size > 1.

Medusa and EAGLE heads read the target's final hidden states (EAGLE-3 also the residual streams
entering a few of its layers), but at P > 1 those live on the last stage (and on whichever stage
holds each EAGLE-3 layer), while the heads, their draft KV pools and every sequence's draft
bookkeeping live on rank 0 beside the scheduler. The heads stay on rank 0 and the hidden rows
travel to it, once per step, after the step's logits:

- Medusa (``keep_hidden`` True): the final hidden state of each sampling row only, hidden_size
  values a row, next to the logits row (vocabulary floats) a verification step sends anyway;
- EAGLE / EAGLE-3 / MTP (``keep_hidden == "all"``): every computed row (each one fills a draft slot),
  the same size as the activations that cross each stage boundary; EAGLE-3's aux streams come
  from the stage holding each layer (stage 0's are rank 0's own).

Why not run the heads on the last stage and send only the draft ids: a sequence's next drafts
depend on how many of its drafts rank 0 accepted (the row behind its newest token, and for
EAGLE the draft slots written from the emitted tokens), which the last stage learns only with the
next step; shipping ids would mean running the heads on every verified row (k + 1 times the head
work) or a second round trip per step. The hidden rows are small beside the logits and the
activations already sent.

Sends are asynchronous (a stage never waits for rank 0 to take them) and untagged: NCCL has no
tags, so each pair's messages are matched in order. The last stage sends its final rows after
the step's result (logits, ids or sampled rows), then its own aux streams; rank 0 receives in that
order, then every other stage's aux in stage order. Speculative decoding keeps one step in
flight, so no two steps' rows interleave.
"""

from __future__ import annotations

import torch


def keep_hidden_mode(config) -> bool | str:
    """What every rank keeps of a step for the heads: the sampling rows (Medusa), every row
    (EAGLE), or nothing."""
    spec = getattr(config, "speculative_config", None)
    if spec is None:
        return False
    if spec.method == "medusa":
        return True
    if spec.method in ("eagle", "eagle3", "mtp"):
        return "all"
    return False


def wanted(worker, rows) -> bool:
    return worker.keep_hidden == "all" or (worker.keep_hidden is True and bool(rows))


def stage_aux_layers(worker) -> list[int]:
    """The aux (hook-numbered) layers this stage holds, in order."""
    return [i for i in sorted(worker.model.aux_hidden_layers or ()) if worker.layer_start <= i < worker.layer_end]


def send(worker, rows: list[int], final: torch.Tensor | None) -> None:
    """A stage's part (its first TP shard, not rank 0): its aux streams, and on the last stage
    the final hidden rows (`final`: every row of the step)."""
    import torch.distributed as dist

    if worker.global_rank % worker.tp or not wanted(worker, rows):
        return
    for work, _ in worker.hidden_sends:  # the previous step's, long taken by now
        work.wait()
    worker.hidden_sends = []
    if worker.last:
        if worker.keep_hidden is True and len(rows) != final.shape[0]:
            final = final[torch.tensor(rows, device=final.device)]
        final = final.contiguous()
        worker.hidden_sends.append((dist.isend(final, 0), final))
    if worker.keep_hidden == "all" and stage_aux_layers(worker):
        data = torch.stack(list(worker.model.aux_hidden)).contiguous()
        worker.hidden_sends.append((dist.isend(data, 0), data))


def receive(worker, rows: list[int], num_tokens: int) -> None:
    """Rank 0: sets last_hidden (and last_aux_hidden, in hook order) from the other stages."""
    import torch.distributed as dist

    if not wanted(worker, rows):
        worker.last_hidden, worker.last_aux_hidden = None, []
        return
    H = worker.model_config.hidden_size
    n = num_tokens if worker.keep_hidden == "all" else len(rows)
    final = torch.empty(n, H, dtype=worker.dtype, device=worker.device)
    dist.recv(final, worker.logits_rank)
    aux: list[torch.Tensor] = []
    if worker.keep_hidden == "all" and worker.model.aux_hidden_layers:
        aux.extend(worker.model.aux_hidden)  # stage 0's own
        layers = sorted(worker.model.aux_hidden_layers)
        for stage, (start, end) in enumerate(worker.ranges[1:], start=1):
            count = sum(start <= i < end for i in layers)
            if count:
                buf = torch.empty(count, num_tokens, H, dtype=worker.dtype, device=worker.device)
                dist.recv(buf, stage * worker.tp)
                aux.extend(buf.unbind(0))
    worker.last_hidden, worker.last_aux_hidden = final, aux
