"""InputProcessor: a raw request (prompt, sampling parameters) becomes the engine's `Request`s.

Everything that can reject a request happens here, before anything is queued: the request id,
the prompt (tokenized, or token ids checked against the vocabulary), the sampling parameters,
the fit within max_model_len and the KV cache, stop token ids, and the grammar (compiled, or
its compile error raised). A batch is checked whole before any of it is admitted, so a bad
request in it leaves the engine as it was: no output, no metric, no block.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from kvserve.runtime.engine.detokenizer import IncrementalDetokenizer
from kvserve.runtime.engine.prefix_cache import extra_key
from kvserve.runtime.engine.request import Request
from kvserve.runtime.engine.sequence import Sequence
from kvserve.runtime.outputs import RequestMetrics
from kvserve.runtime.sampler import SamplingRow
from kvserve.runtime.sampling_params import SamplingParams
from kvserve.runtime.stats import StatsCollector

Prompt = str | list[int] | dict[str, Any]


@dataclass(frozen=True)
class _Checked:
    """A request that passed every check but its grammar's."""

    request_id: str
    prompt_text: str | None
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    cache_extra: bytes | None
    lora_request: Any = None


class InputProcessor:
    def __init__(self, tokenizer: Any, decode: Callable[[list[int], bool], str], *, vocab_size: int,
                 max_model_len: int, eos_token_ids: frozenset[int], check_fits: Callable[[int, int], None],
                 structured_outputs, device: torch.device) -> None:
        self.tokenizer = tokenizer
        self._decode = decode
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self._eos = eos_token_ids
        self._check_fits = check_fits  # the scheduler's: max_model_len, KV cache, step budget
        self.structured_outputs = structured_outputs
        self._device = device

    def process_batch(self, requests: Iterable[tuple[str, Prompt, SamplingParams | dict | None]],
                      in_use: Callable[[str], bool], arrival_time: float | None = None,
                      wait_for_grammars: bool = False, lora_requests: list | None = None,
                      lora_cache_key: Callable[[int], bytes] | None = None) -> list[Request]:
        """Every request of the batch, checked; raises the first ValueError (naming the field).
        `wait_for_grammars` settles every grammar here (an offline batch: a bad schema raises
        before anything runs) rather than leaving a slow one to finish while the engine steps.
        `lora_requests[i]` is request i's adapter (already registered; None: the base model),
        whose `lora_cache_key` keeps its prefix-cache blocks apart."""
        batch = list(requests)
        loras = lora_requests if lora_requests is not None else [None] * len(batch)
        seen: set[str] = set()
        for request_id, _, _ in batch:
            if not isinstance(request_id, str) or not request_id:
                raise ValueError("request_id: must be a non-empty string")
            if request_id in seen or in_use(request_id):
                raise ValueError(f"request_id: {request_id!r} is already in use")
            seen.add(request_id)
        checked = [self._check(rid, prompt, self.sampling_params(params), lora,
                               None if lora is None else lora_cache_key(lora.lora_int_id))
                   for (rid, prompt, params), lora in zip(batch, loras)]
        # Grammars last (the rest is cheap), compiled in parallel in the manager's threads. One
        # already compiled (the server compiles before adding, and the cache keeps it) or failed
        # is settled here; one still compiling is admitted and waits in the core, costing the
        # running batch nothing.
        grammars = [self.structured_outputs.compile(c.params.structured_outputs)
                    if c.params.structured_outputs is not None else None for c in checked]
        if wait_for_grammars:
            concurrent.futures.wait([g for g in grammars if g is not None])
        compiled = [g.result() if g is not None and g.done() else None for g in grammars]  # a ValueError
        return [self._build(c, grammar, done, arrival_time) for c, grammar, done in zip(checked, grammars, compiled)]

    @staticmethod
    def sampling_params(params: SamplingParams | dict | None) -> SamplingParams:
        if params is None:
            return SamplingParams()
        if isinstance(params, dict):
            return SamplingParams(**params)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: expected SamplingParams, got {type(params).__name__}")
        return params

    def _check(self, request_id: str, prompt: Prompt, params: SamplingParams, lora_request: Any = None,
               lora_key: bytes | None = None) -> _Checked:
        prompt_text, prompt_ids = self.tokenize(prompt)
        cache_salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError("cache_salt: must be a non-empty string")
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = max(1, self.max_model_len - len(prompt_ids))
        self._check_fits(len(prompt_ids), max_tokens)
        for t in params.stop_token_ids:
            if t >= self.vocab_size:
                raise ValueError(f"stop_token_ids: {t} is outside the vocabulary [0, {self.vocab_size})")
        return _Checked(request_id, prompt_text, prompt_ids, params, max_tokens, extra_key(cache_salt, lora_key),
                        lora_request)

    def _build(self, c: _Checked, grammar: concurrent.futures.Future | None, compiled,
               arrival_time: float | None) -> Request:
        metrics = RequestMetrics(arrival_time=arrival_time or StatsCollector.now())
        samples = [self._new_sample(c.request_id, c.prompt_text, c.prompt_ids, c.max_tokens, c.params, metrics,
                                    c.cache_extra, index) for index in range(c.params.n)]
        if c.lora_request is not None:
            for s in samples:
                s.lora_request = c.lora_request
                s.seq.lora_int_id = c.lora_request.lora_int_id
        if c.params.n > 1:
            samples[0].unforked = samples[1:]
            for s in samples:
                s.group = samples
        if compiled is not None:
            self.attach_grammar(samples[0], compiled)
        elif grammar is not None:
            samples[0].pending_grammar = grammar
        return samples[0]

    def attach_grammar(self, head: Request, compiled) -> None:
        for s in head.samples:  # one matcher per sample: n > 1 samples diverge
            s.row.grammar = self.structured_outputs.new_state(compiled)

    def _new_sample(self, request_id: str, prompt_text: str | None, prompt_ids: list[int], max_tokens: int,
                    params: SamplingParams, metrics: RequestMetrics, cache_extra: bytes | None,
                    index: int) -> Request:
        seq = Sequence(request_id, prompt_ids, max_tokens, arrival_time=metrics.arrival_time,
                       cache_extra=cache_extra)
        generator = None
        if params.seed is not None and not params.greedy:
            # seed + index: distinct samples, each reproducible whatever else runs.
            generator = torch.Generator(device=self._device).manual_seed(params.seed + index)
        banned = sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else set(self._eos)))
        return Request(
            request_id=request_id,
            prompt=prompt_text,
            params=params,
            seq=seq,
            detok=IncrementalDetokenizer(self._decode, prompt_ids,
                                         skip_special_tokens=params.skip_special_tokens,
                                         stop=params.stop,
                                         include_stop_str_in_output=params.include_stop_str_in_output),
            metrics=metrics if index == 0 else RequestMetrics(arrival_time=metrics.arrival_time),
            row=SamplingRow(params, seq.token_ids, len(prompt_ids), generator, banned),
            stop_token_ids=frozenset(params.stop_token_ids),
            eos_token_ids=frozenset() if params.ignore_eos else self._eos,
            logprobs=[] if params.logprobs is not None else None,
            cumulative_logprob=0.0 if params.logprobs is not None else None,
            index=index,
        )

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        text = None
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            text = prompt
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict):
            unknown = sorted(set(prompt) - {"prompt_token_ids", "prompt", "cache_salt"})
            if unknown:
                raise ValueError(f"prompt: unknown field {unknown[0]!r}")
            if "prompt_token_ids" not in prompt:
                raise ValueError("prompt_token_ids: missing")
            ids = prompt["prompt_token_ids"]
            text = prompt.get("prompt")
        elif isinstance(prompt, (list, tuple)):
            ids = prompt
        else:
            raise ValueError(f"prompt: expected a string, a token id list or "
                             f"{{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
        ids = list(ids)
        if not ids:
            raise ValueError("prompt: must not be empty" if text is not None or isinstance(prompt, str)
                             else "prompt_token_ids: must not be empty")
        self.check_token_ids(ids, "prompt_token_ids")
        return text, ids

    def check_token_ids(self, ids: Iterable[Any], field: str) -> None:
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(f"{field}: {t!r} is not a token id in the vocabulary [0, {self.vocab_size})")
