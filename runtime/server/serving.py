"""From validated requests to engine requests, and from engine outputs to OpenAI responses.

Pure functions of their inputs (no I/O), so the response shapes are tested without a server.
`n > 1` is one engine request per prompt with n samples sharing the prompt's KV blocks; with a
seed, the engine gives sample j seed + j so the choices differ as they do in vLLM.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvserve.runtime.sampling_params import SamplingParams

from .errors import APIError
from .protocol import ChatCompletionRequest, CompletionRequest, _Sampling
from .structured import OutputPlan
from .tool_parsers import ToolParser

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # as OpenAI and vLLM default for /v1/completions


def engine_error(exc: ValueError) -> APIError:
    """The engine's ValueError ("field: why") as a 400 naming that field."""
    msg = str(exc)
    head, sep, _ = msg.partition(": ")
    param = head if sep and " " not in head else None
    if param == "prompt_token_ids":
        param = "prompt"
    return APIError(400, msg, param=param)


def sampling_params(req: _Sampling, *, max_tokens: int | None, logprobs: int | None,
                    outputs: OutputPlan | None = None) -> SamplingParams:
    outputs = outputs or OutputPlan()
    seed = req.seed
    fields: dict[str, Any] = dict(
        n=req.n,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k is None else req.top_k,
        min_p=0.0 if req.min_p is None else req.min_p,
        seed=seed,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        stop=req.stop_list(),
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        logprobs=logprobs,
        skip_special_tokens=req.skip_special_tokens if outputs.skip_special_tokens is None else outputs.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        structured_outputs=outputs.structured,
    )
    try:
        return SamplingParams(**fields)
    except ValueError as exc:
        raise engine_error(exc) from None


@dataclass
class Choice:
    """One choice being generated: its engine request and what has been sent so far."""

    index: int
    request_id: str
    prompt_index: int
    sample: int = 0  # which of the engine request's n samples
    num_cached_tokens: int = 0
    sent_text: str = ""
    sent_tokens: int = 0
    sent_logprobs: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None
    finish_reason: str | None = None
    stop_reason: Any = None
    role_sent: bool = False
    # Tool calls: the parser reading this choice's text, and what has been streamed of it.
    tool_parser: ToolParser | None = None
    sent_content: str = ""
    sent_calls: list[dict] = field(default_factory=list)  # {"id", "arguments"} per streamed call


@dataclass
class Plan:
    """Everything needed to run one HTTP request on the engine and answer it."""

    kind: str  # "completion" | "chat"
    id: str
    created: int
    model: str
    prompts: list[tuple[str | None, list[int]]]  # (text, token ids) per prompt
    choices: list[Choice]
    engine_requests: list[tuple[str, Any, SamplingParams]]
    stream: bool
    include_usage: bool
    continuous_usage: bool
    echo: bool
    logprobs: int | None  # completions: top-N; chat: top_logprobs (0 with logprobs=true)
    want_logprobs: bool
    outputs: OutputPlan = field(default_factory=OutputPlan)
    # Held while the request runs, so the engine thread finds the stop automaton already built.
    stop_automaton: Any = None
    lora_request: Any = None  # the LoRA adapter the request's `model` names (None: the base model)

    @property
    def by_request(self) -> dict[str, list[Choice]]:
        out: dict[str, list[Choice]] = {}
        for c in self.choices:
            out.setdefault(c.request_id, []).append(c)
        return out

    def prompt_tokens(self) -> int:
        return sum(len(ids) for _, ids in self.prompts)

    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    def usage(self) -> dict:
        p, c = self.prompt_tokens(), self.completion_tokens()
        cached = sum(ch.num_cached_tokens for ch in self.choices if ch.sample == 0)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": cached}}


def make_plan(kind: str, req: CompletionRequest | ChatCompletionRequest, model: str,
              prompts: list[tuple[str | None, list[int]]], outputs: OutputPlan | None = None) -> Plan:
    prefix = "cmpl" if kind == "completion" else "chatcmpl"
    pid = f"{prefix}-{uuid.uuid4().hex}"
    if kind == "completion":
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        logprobs = req.logprobs
        want = req.logprobs is not None
        echo = req.echo
    else:
        max_tokens = req.max_tokens  # None: up to the context length
        want = req.logprobs
        logprobs = (req.top_logprobs or 0) if want else None
        echo = False
    choices, engine_requests = [], []
    outputs = outputs or OutputPlan()
    params = sampling_params(req, max_tokens=max_tokens, logprobs=logprobs, outputs=outputs)
    for p, (text, ids) in enumerate(prompts):
        rid = f"{pid}-{p}"
        prompt: Any = {"prompt_token_ids": ids} if text is None else {"prompt_token_ids": ids, "prompt": text}
        if req.cache_salt is not None:
            prompt["cache_salt"] = req.cache_salt
        engine_requests.append((rid, prompt, params))
        for j in range(req.n):
            choices.append(Choice(index=p * req.n + j, request_id=rid, prompt_index=p, sample=j,
                                  tool_parser=outputs.parser() if outputs.parser is not None else None))
    opts = req.stream_options
    return Plan(kind=kind, id=pid, created=int(time.time()), model=model, prompts=prompts, choices=choices,
                engine_requests=engine_requests, stream=req.stream,
                include_usage=bool(opts and opts.include_usage), continuous_usage=bool(opts and opts.continuous_usage_stats),
                echo=echo, logprobs=logprobs, want_logprobs=want, outputs=outputs)


def apply_output(choice: Choice, out: Any) -> None:
    c = out.outputs[choice.sample]
    choice.num_cached_tokens = getattr(out, "num_cached_tokens", 0) or 0
    choice.text = c.text
    choice.token_ids = list(c.token_ids)
    choice.logprobs = c.logprobs
    choice.finish_reason = c.finish_reason
    choice.stop_reason = c.stop_reason


# -- logprobs ---------------------------------------------------------------------------------------
def _completion_logprobs(entries: list, token_ids: list[int], offset0: int) -> dict:
    tokens, token_lps, tops, offsets = [], [], [], []
    pos = offset0
    for tid, entry in zip(token_ids, entries):
        chosen = entry.get(tid)
        text = chosen.decoded_token if chosen is not None and chosen.decoded_token is not None else ""
        tokens.append(text)
        token_lps.append(chosen.logprob if chosen is not None else None)
        tops.append({(lp.decoded_token or ""): lp.logprob for t, lp in entry.items()})
        offsets.append(pos)
        pos += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _chat_logprobs(entries: list, token_ids: list[int], top_n: int) -> dict:
    content = []
    for tid, entry in zip(token_ids, entries):
        chosen = entry.get(tid)
        tok = chosen.decoded_token if chosen is not None and chosen.decoded_token is not None else ""
        top = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None), key=lambda x: x[1].rank)[:top_n]
        content.append({
            "token": tok,
            "logprob": chosen.logprob if chosen is not None else None,
            "bytes": list(tok.encode("utf-8")),
            "top_logprobs": [{"token": lp.decoded_token or "", "logprob": lp.logprob,
                              "bytes": list((lp.decoded_token or "").encode("utf-8"))} for _, lp in top],
        })
    return {"content": content}


def _logprobs_for(plan: Plan, choice: Choice, start: int, end: int) -> dict | None:
    if not plan.want_logprobs or choice.logprobs is None:
        return None
    entries, ids = choice.logprobs[start:end], choice.token_ids[start:end]
    if plan.kind == "completion":
        # text_offset indexes the returned text, which starts with the prompt under echo.
        echoed = len(plan.prompts[choice.prompt_index][0] or "") if plan.echo else 0
        return _completion_logprobs(entries, ids, echoed + len(choice.sent_text))
    return _chat_logprobs(entries, ids, plan.logprobs or 0)


# -- tool calls -----------------------------------------------------------------------------------
def _tool_finish_reason(plan: Plan, choice: Choice, num_calls: int) -> str | None:
    # As OpenAI and vLLM: calls the model chose to make (auto, required) end with "tool_calls";
    # a named tool choice is an answer in a forced format and ends with "stop".
    if num_calls and choice.finish_reason == "stop" and plan.outputs.tool_mode in ("auto", "required"):
        return "tool_calls"
    return choice.finish_reason


def _chat_message(plan: Plan, choice: Choice) -> tuple[dict, str | None]:
    if choice.tool_parser is None:
        return {"role": "assistant", "content": choice.text}, choice.finish_reason
    parsed = choice.tool_parser.parse(choice.text, True)
    calls = [c for c in parsed.calls if c.complete]
    if not calls:
        return {"role": "assistant", "content": parsed.content}, choice.finish_reason
    message = {"role": "assistant", "content": parsed.content if parsed.content.strip() else None,
               "tool_calls": [{"id": choice.tool_parser.new_call_id(), "type": "function",
                               "function": {"name": c.name, "arguments": c.arguments}} for c in calls]}
    return message, _tool_finish_reason(plan, choice, len(calls))


def _tool_stream_delta(choice: Choice, finished: bool) -> dict:
    """The delta that brings the client from what it was sent to the parser's latest snapshot:
    new content, then each new call's id and name (once known), then argument fragments."""
    parser = choice.tool_parser
    parsed = parser.parse(choice.text, finished)
    delta: dict = {}
    if parsed.content.startswith(choice.sent_content) and len(parsed.content) > len(choice.sent_content):
        delta["content"] = parsed.content[len(choice.sent_content):]
        choice.sent_content = parsed.content
    calls = []
    for k, call in enumerate(parsed.calls):
        if k < len(choice.sent_calls):
            sent = choice.sent_calls[k]
            if call.arguments.startswith(sent["arguments"]) and len(call.arguments) > len(sent["arguments"]):
                calls.append({"index": k, "function": {"arguments": call.arguments[len(sent["arguments"]):]}})
                sent["arguments"] = call.arguments
            continue
        if call.name is None:
            break  # its name comes first, whatever order the model wrote the keys in
        cid = parser.new_call_id()
        choice.sent_calls.append({"id": cid, "arguments": call.arguments})
        calls.append({"index": k, "id": cid, "type": "function",
                      "function": {"name": call.name, "arguments": call.arguments}})
    if calls:
        delta["tool_calls"] = calls
    return delta


# -- full responses -------------------------------------------------------------------------------
def final_response(plan: Plan) -> dict:
    choices = []
    for c in plan.choices:
        lp = _logprobs_for(plan, c, 0, len(c.token_ids))
        if plan.kind == "completion":
            text = c.text
            if plan.echo:
                ptext, pids = plan.prompts[c.prompt_index]
                text = (ptext if ptext is not None else "") + text
            choices.append({"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason})
        else:
            message, finish_reason = _chat_message(plan, c)
            choices.append({"index": c.index, "message": message, "logprobs": lp, "finish_reason": finish_reason,
                            "stop_reason": c.stop_reason})
    obj = "text_completion" if plan.kind == "completion" else "chat.completion"
    return {"id": plan.id, "object": obj, "created": plan.created, "model": plan.model, "choices": choices,
            "usage": plan.usage()}


# -- streaming ------------------------------------------------------------------------------------
def _chunk(plan: Plan, choices: list[dict]) -> dict:
    obj = "text_completion" if plan.kind == "completion" else "chat.completion.chunk"
    chunk = {"id": plan.id, "object": obj, "created": plan.created, "model": plan.model, "choices": choices}
    if plan.continuous_usage:
        chunk["usage"] = plan.usage()
    return chunk


def stream_chunks(plan: Plan, choice: Choice) -> list[dict]:
    """The chunks to send for one choice after its latest output was applied."""
    out = []
    if plan.kind == "chat" and not choice.role_sent:
        choice.role_sent = True
        out.append(_chunk(plan, [{"index": choice.index, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}]))
    if plan.kind == "completion" and plan.echo and not choice.role_sent:
        choice.role_sent = True
        ptext = plan.prompts[choice.prompt_index][0] or ""
        if ptext:
            out.append(_chunk(plan, [{"index": choice.index, "text": ptext, "logprobs": None,
                                      "finish_reason": None}]))
    delta = choice.text[len(choice.sent_text):]
    new_tokens = len(choice.token_ids)
    finished = choice.finish_reason is not None
    tool_delta = _tool_stream_delta(choice, finished) if choice.tool_parser is not None and (delta or finished) else None
    if tool_delta is not None and not tool_delta and not finished:
        return out  # everything new is held back (a tool-call marker may be starting)
    if delta or finished:
        lp = _logprobs_for(plan, choice, choice.sent_tokens, new_tokens) if delta or finished else None
        fr = choice.finish_reason
        if plan.kind == "completion":
            body = {"index": choice.index, "text": delta, "logprobs": lp, "finish_reason": fr}
        elif tool_delta is not None:
            fr = _tool_finish_reason(plan, choice, len(choice.sent_calls)) if finished else None
            body = {"index": choice.index, "delta": tool_delta, "logprobs": lp, "finish_reason": fr}
        else:
            body = {"index": choice.index, "delta": {"content": delta} if delta else {}, "logprobs": lp,
                    "finish_reason": fr}
        if finished:
            body["stop_reason"] = choice.stop_reason
        out.append(_chunk(plan, [body]))
        choice.sent_text = choice.text
        choice.sent_tokens = new_tokens
    return out


def usage_chunk(plan: Plan) -> dict:
    obj = "text_completion" if plan.kind == "completion" else "chat.completion.chunk"
    return {"id": plan.id, "object": obj, "created": plan.created, "model": plan.model, "choices": [],
            "usage": plan.usage()}
