"""OutputProcessor: a step's token updates become `RequestOutput`s, latency observations and
token counters; logprob entries get their decoded text here.

Text is decoded when an output is built (lazily for requests without stop strings; those with
stop strings were decoded token by token as the stop checker fed them), so on the overlapped
engine this runs while the next forward pass does.
"""

from __future__ import annotations

from collections.abc import Callable

from kvserve.runtime.engine.request import Request
from kvserve.runtime.engine.scheduler import StepUpdate
from kvserve.runtime.outputs import CompletionOutput, RequestOutput
from kvserve.runtime.stats import StatsCollector


class OutputProcessor:
    def __init__(self, decode: Callable[[list[int], bool], str], stats: StatsCollector) -> None:
        self._decode = decode
        self._stats = stats

    def process(self, update: StepUpdate, now: float) -> list[Request]:
        """Records the step's metrics; returns the heads (sample 0) whose output changed, one per
        request, in schedule order."""
        stats = self._stats
        stats.on_tokens(now, update.num_prompt_tokens, update.num_generated_tokens)
        stats.spec_num_drafts += update.num_spec_runs
        stats.spec_num_draft_tokens += update.num_draft_tokens
        stats.spec_num_accepted_tokens += update.num_accepted_tokens
        changed: dict[str, Request] = {}
        done: dict[str, Request] = {}
        for su in update.samples:
            req = su.req
            m = req.metrics
            for _ in range(su.num_tokens):
                if m.first_token_time is None:
                    m.first_token_time = now
                    if req.index == 0:  # one TTFT per request, whatever n is
                        stats.time_to_first_token.append(now - m.arrival_time)
                else:
                    stats.inter_token_latencies.append(now - m.last_token_time)
                m.last_token_time = now
            lp = su.logprobs
            if lp is not None:
                for tid, entry in lp.items():
                    entry.decoded_token = self._decode([tid], False)
                req.logprobs.append(lp)
                req.cumulative_logprob += lp[req.seq.token_ids[-1]].logprob
            head = req.head
            if su.finished:
                m.finished_time = now
                if head.all_finished:
                    done[head.request_id] = req  # the last sample to finish names the reason
            changed[head.request_id] = head
        for req in done.values():
            head = req.head
            head.metrics.finished_time = now
            stats.e2e_latencies.append(now - head.metrics.arrival_time)
            stats.request_success_total[req.finish_reason] += 1
        return list(changed.values())

    def make_outputs(self, heads: list[Request]) -> list[RequestOutput]:
        return [self.make_output(head, finished=head.all_finished) for head in heads]

    def make_output(self, req: Request, finished: bool) -> RequestOutput:
        seq = req.seq
        completions = [
            CompletionOutput(
                index=s.index,
                text=s.detok.visible_text(s.finish_reason is not None),
                token_ids=s.seq.output_token_ids,
                finish_reason=s.finish_reason,
                logprobs=list(s.logprobs) if s.logprobs is not None else None,
                cumulative_logprob=s.cumulative_logprob,
                stop_reason=s.stop_reason,
            )
            for s in req.samples
        ]
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=req.metrics,
            num_cached_tokens=seq.num_cached_tokens or 0,
            lora_request=req.lora_request,
        )
