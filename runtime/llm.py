"""The offline API: ``LLM(model=DIR).generate(prompts, SamplingParams(...))``, as in vLLM."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from kvserve.runtime.config import EngineConfig
from kvserve.runtime.engine import LLMEngine, Prompt
from kvserve.runtime.lora.request import LoRARequest
from kvserve.runtime.outputs import RequestOutput
from kvserve.runtime.sampling_params import SamplingParams

Message = dict[str, Any]


class LLM:
    """Loads a model once and runs batches of prompts to completion with continuous batching.

    Keyword arguments are EngineConfig's (dtype, device, block_size, num_kv_blocks,
    kv_cache_memory_bytes, max_model_len, max_num_seqs, max_num_batched_tokens,
    enable_chunked_prefill, seed, attention_backend, ...).
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_args(model=str(model), **kwargs))
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def close(self) -> None:
        """Stops the tensor-parallel worker processes, if any (also done at interpreter exit)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in the order of `prompts`.
        `lora_request`: one adapter for every prompt, or one (or None: the base model) per prompt
        (needs ``LLM(..., enable_lora=True)``)."""
        if isinstance(prompts, (str, dict, bytes)) or not hasattr(prompts, "__iter__") or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):  # one prompt; a non-iterable one (None, 5) is then refused by add_request with a ValueError
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"sampling_params: {len(params_list)} given for {len(prompts)} prompts")
        return self._run(prompts, params_list, use_tqdm, lora_request)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Renders one conversation (or a list of them) with the tokenizer's chat template.

        ``tools`` (OpenAI's ``[{"type": "function", "function": {...}}]``) go to the template as
        its ``tools`` variable; templates that know tools render them. Assistant messages may
        carry ``tool_calls`` and ``tool`` messages the results, as templates expect them."""
        tokenizer = self.engine.tokenizer
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError("chat_template: the tokenizer has no chat template; pass chat_template=")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if not all(isinstance(c, list) and all(isinstance(m, dict) for m in c) for c in conversations):
            raise ValueError("messages: expected a list of {'role', 'content'} dicts or a list of such lists")
        prompts = []
        for conversation in conversations:
            try:
                text = tokenizer.apply_chat_template(conversation, chat_template=chat_template,
                                                     add_generation_prompt=add_generation_prompt,
                                                     tokenize=False, tools=tools,
                                                     **(chat_template_kwargs or {}))
            except Exception as exc:  # Jinja raises anything (UndefinedError, ZeroDivisionError, ...)
                raise ValueError(f"messages: the chat template rejected them: {type(exc).__name__}: {exc}") from None
            # The template already holds any BOS: do not let the tokenizer add another.
            ids = tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt_token_ids": ids, "prompt": text})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def _run(self, prompts: list[Prompt], params_list: list[SamplingParams],
             use_tqdm: bool, lora_request=None) -> list[RequestOutput]:
        engine = self.engine
        ids = [f"llm-{next(self._counter)}" for _ in prompts]
        # All or nothing: a bad prompt or schema raises here and nothing is queued.
        engine.add_requests(zip(ids, prompts, params_list), wait_for_grammars=True, lora_request=lora_request)
        index = {rid: i for i, rid in enumerate(ids)}
        results: list[RequestOutput | None] = [None] * len(prompts)
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(prompts), desc="Processed prompts", dynamic_ncols=True)
        generated = 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    i = index.get(out.request_id)
                    if i is None:
                        continue
                    if out.finished:
                        results[i] = out
                        if bar is not None:
                            generated += len(out.outputs[0].token_ids)
                            bar.update(1)
                            elapsed = bar.format_dict.get("elapsed") or 0
                            if elapsed:
                                bar.set_postfix_str(f"output {generated / elapsed:.1f} tok/s", refresh=False)
        except BaseException:
            for rid in ids:
                engine.abort_request(rid)
            engine.step()
            raise
        finally:
            if bar is not None:
                bar.close()
        return results  # type: ignore[return-value]
