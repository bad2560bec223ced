"""A request's runtime block hashes, computed in the router exactly as a pod computes them.

The same tokenizer (`--tokenizer`, the model's), the same chat rendering and tokenization as the
server (runtime/server/app.py's `_chat_prompt` and `_tokenize`, the request parsed by the
server's own protocol models), the same hash chain (runtime/engine/prefix_cache.py) with the
request's `cache_salt`. Anything the server would reject gives None: the request is then routed
by the approximate index, and the pod answers the 400 in its own words.

Bounded: only the first `max_chars` characters of a text prompt are tokenized (the blocks near
the cut are dropped, their tokens could change), and at most `MAX_BLOCKS` hashes are computed.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("kvserve.router")

MAX_CHARS = 64 * 1024
MAX_BLOCKS = 4096


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (ValueError, OSError) as exc:
        raise ValueError(f"--tokenizer: no usable tokenizer in {path!r}: {' '.join(str(exc).split())[:200]}") from None


class PromptKeys:
    def __init__(self, tokenizer, *, max_chars: int = MAX_CHARS):
        self.tokenizer, self.max_chars = tokenizer, max_chars

    def token_ids(self, route: str, body: Mapping[str, Any]) -> tuple[list[int], bool] | None:
        """(token ids, whether the text was cut) for a completion or chat request, or None."""
        from pydantic import ValidationError

        from kvserve.runtime.server.app import _chat_prompt, _tokenize
        from kvserve.runtime.server.protocol import ChatCompletionRequest, CompletionRequest

        tok = self.tokenizer
        try:
            if route == "chat":
                req = ChatCompletionRequest.model_validate(body)
                text = _chat_prompt(tok, req.template_messages(), add_generation_prompt=req.add_generation_prompt,
                                    continue_final_message=req.continue_final_message,
                                    kwargs=req.chat_template_kwargs, tools=req.template_tools())
                special = req.add_special_tokens
            else:
                req = CompletionRequest.model_validate(body)
                prompt = req.prompts()[0]  # a batch goes to one pod: placed by its first prompt
                if not isinstance(prompt, str):
                    return list(prompt), False
                text, special = prompt, req.add_special_tokens
        except (ValidationError, ValueError, TypeError, IndexError):
            return None
        except Exception as exc:  # the server's APIError for a template that rejects the messages
            log.debug("request not hashable for KV events: %s", exc)
            return None
        cut = len(text) > self.max_chars
        return _tokenize(tok, text[: self.max_chars], special), cut


def tokenize_request(route: str, body: Mapping[str, Any]) -> tuple[dict[str, Any], bool] | None:
    """The pod's POST /tokenize body that yields the token ids this request is served with, when
    the router has no tokenizer of its own (an operator-run router: the model lives in the pods),
    and whether its text was cut. None when /tokenize cannot say (options it does not take)."""
    model = body.get("model")
    if route == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or body.get("chat_template_kwargs") \
                or body.get("continue_final_message") or body.get("add_special_tokens"):
            return None
        out = {"model": model, "messages": messages,
               "add_generation_prompt": body.get("add_generation_prompt", True)}
        if body.get("tools"):
            out["tools"] = body["tools"]
        return out, False
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        return None
    return ({"model": model, "prompt": prompt[:MAX_CHARS], "add_special_tokens": body.get("add_special_tokens", True)},
            len(prompt) > MAX_CHARS)
