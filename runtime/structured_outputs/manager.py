"""Grammar compilation (off the engine and server loops, cached) and per-sample grammar matchers.

xgrammar does the work: ``TokenizerInfo`` maps the model's vocabulary (padded to the model's
logits width: rows the tokenizer does not have are never allowed), ``GrammarCompiler`` turns a
schema / regex / EBNF into a ``CompiledGrammar`` (its token-mask cache), and one ``GrammarMatcher``
per sample follows the accepted tokens and fills that sample's row of the step's token bitmask.

Compilation runs in a small thread pool: ``compile()`` returns a Future at once, and the same key
always returns the same Future (finished ones are kept in an LRU), so a schema is compiled once
however many requests use it, and a failed one is refused again without recompiling.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterable

import torch

from kvserve.runtime.structured_outputs.params import StructuredOutputsParams

log = logging.getLogger(__name__)

CACHE_SIZE = 256
COMPILE_THREADS = 2
# Whitespace allowed between JSON tokens (xgrammar's max_whitespace_cnt): enough for any
# pretty-printing, while a model that keeps choosing whitespace cannot loop until max_tokens.
MAX_JSON_WHITESPACE = 32


def _string_lengths_as_patterns(node: Any) -> Any:
    """A copy of a JSON schema whose length-bounded strings are written as patterns.

    xgrammar 0.2.8 compiles ``{"type": "string", "maxLength": n}`` to a character class that
    lets raw control characters (U+0000..U+001F) through, which is not valid JSON; a pattern of
    the same length bounds excludes them (and, like the length rule, quotes and backslashes)."""
    if isinstance(node, list):
        return [_string_lengths_as_patterns(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _string_lengths_as_patterns(v) for k, v in node.items()}
    if (out.get("type") == "string" and ("maxLength" in out or "minLength" in out)
            and not {"pattern", "format", "enum", "const"} & out.keys()):
        low, high = out.get("minLength", 0), out.get("maxLength")
        if all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (low, high) if v is not None):
            out.pop("minLength", None)
            out.pop("maxLength", None)
            out["pattern"] = "^[^\\x00-\\x1f]{%d,%s}$" % (low, "" if high is None else high)
        # anything else (not integers) is left for xgrammar to refuse
    return out


def _ebnf_literal(text: str) -> str:
    # JSON string escaping is a subset of what xgrammar's EBNF literals accept.
    import json

    return json.dumps(text, ensure_ascii=False)


def choice_grammar(choices: list[str]) -> str:
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in choices)


class GrammarState:
    """One sample's position in its grammar. Only the engine thread touches it."""

    __slots__ = ("matcher", "manager")

    def __init__(self, matcher: Any, manager: "StructuredOutputManager") -> None:
        self.matcher = matcher
        self.manager = manager

    def accept(self, token_id: int) -> bool:
        """Advances by one sampled token; False if the grammar does not allow it (nothing changes)."""
        return bool(self.matcher.accept_token(token_id))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)

    @property
    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())


class StructuredOutputManager:
    """Built lazily by the engine on the first structured request (xgrammar imports and the
    vocabulary scan cost ~1 s for a 50k vocabulary, paid in the compile thread, not the loop)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(set(stop_token_ids))
        self._lock = threading.Lock()
        self._futures: OrderedDict[tuple, Future] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=COMPILE_THREADS, thread_name_prefix="kvserve-grammar")
        self._compiler = None
        self._compiler_lock = threading.Lock()
        self._bitmask: torch.Tensor | None = None
        # Observations for the engine's stats: compile seconds, drained by get_stats().
        self.compile_times: deque[float] = deque(maxlen=10_000)

    # -- compilation (any thread) --------------------------------------------------------------------
    def compile(self, params: StructuredOutputsParams) -> Future:
        """A Future of the compiled grammar; its exception is a ValueError naming the field."""
        key = params.key()
        with self._lock:
            fut = self._futures.get(key)
            if fut is not None and not fut.cancelled():
                self._futures.move_to_end(key)
                return fut
            fut = self._pool.submit(self._compile, params)
            self._futures[key] = fut
            while len(self._futures) > CACHE_SIZE:
                old_key, old = next(iter(self._futures.items()))
                if not old.done():
                    break  # still compiling: someone waits on it
                del self._futures[old_key]
        return fut

    def _get_compiler(self):
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids or None)
                # Special tokens (<|im_start|>, <s>, ...) are text to xgrammar, but the
                # detokenizer drops them: an empty entry is one xgrammar never allows.
                special = {t for t in getattr(self.tokenizer, "all_special_ids", [])}
                special |= {i for i, t in getattr(self.tokenizer, "added_tokens_decoder", {}).items()
                            if getattr(t, "special", False)}
                special -= set(info.stop_token_ids)
                if special:
                    vocab = list(info.decoded_vocab)
                    for i in special:
                        if 0 <= i < len(vocab):
                            vocab[i] = b""
                    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=self.vocab_size,
                                             stop_token_ids=list(info.stop_token_ids), add_prefix_space=False)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def _compile(self, params: StructuredOutputsParams):
        kind = params.kind
        try:
            compiler = self._get_compiler()
        except Exception as exc:  # e.g. a tokenizer type xgrammar does not know
            raise ValueError(f"structured_outputs.{kind}: this model's tokenizer cannot be used by the grammar "
                             f"engine: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}") from None
        start = time.perf_counter()
        try:
            if kind == "json":
                import json

                schema = json.dumps(_string_lengths_as_patterns(params.schema()))
                compiled = self._compile_schema(compiler, schema, params)
            elif kind == "json_object":
                compiled = self._compile_schema(compiler, '{"type": "object"}', params)
            elif kind == "regex":
                compiled = compiler.compile_regex(params.regex)
            elif kind == "choice":
                compiled = compiler.compile_grammar(choice_grammar(params.choice))
            else:
                compiled = compiler.compile_grammar(params.grammar)
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError with its parser's message
            what = {"json": "an invalid JSON schema", "regex": "a regex the grammar engine cannot compile",
                    "grammar": "an invalid EBNF grammar", "choice": "choices that cannot be compiled",
                    "json_object": "the JSON grammar failed"}[kind]
            detail = " ".join(str(exc).split())[:500]
            raise ValueError(f"structured_outputs.{kind}: {what}: {detail}") from None
        self.compile_times.append(time.perf_counter() - start)
        return compiled

    def drain_compile_times(self) -> list[float]:
        """Compile durations (seconds) since the previous call; each is returned once."""
        out = []
        while True:
            try:
                out.append(self.compile_times.popleft())
            except IndexError:
                return out

    @staticmethod
    def _compile_schema(compiler, schema: str, params: StructuredOutputsParams):
        if params.disable_any_whitespace:
            return compiler.compile_json_schema(schema, any_whitespace=False)
        return compiler.compile_json_schema(schema, any_whitespace=True, max_whitespace_cnt=MAX_JSON_WHITESPACE)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- matchers (engine thread) ----------------------------------------------------------------------
    def new_state(self, compiled: Any) -> GrammarState:
        import xgrammar as xgr

        return GrammarState(xgr.GrammarMatcher(compiled), self)

    def bitmask(self, num_rows: int) -> torch.Tensor:
        """The step's bitmask buffer (int32, one bit per vocabulary entry), reused across steps."""
        words = (self.vocab_size + 31) // 32
        buf = self._bitmask
        if buf is None or buf.shape[0] < num_rows:
            buf = self._bitmask = torch.empty((max(num_rows, 8), words), dtype=torch.int32)
        return buf[:num_rows]


def apply_grammar_bitmask(logits: torch.Tensor, states: list[GrammarState | None]) -> None:
    """Masks, in place, the logits rows whose sample has a grammar (states[i] for row i; None rows
    are untouched): one bitmask for the whole step, each grammar row filled by its matcher, then
    applied once. Columns past the grammar's vocabulary (a padded LM head) are masked too."""
    import xgrammar as xgr

    rows = [i for i, s in enumerate(states) if s is not None and not s.is_terminated]
    if not rows:
        return
    manager = states[rows[0]].manager
    mask = manager.bitmask(logits.shape[0])
    for i in rows:
        states[i].matcher.fill_next_token_bitmask(mask, i)
    if logits.device.type != "cpu":
        mask = mask.to(logits.device, non_blocking=True)
    if logits.shape[1] > manager.vocab_size:
        logits[rows, manager.vocab_size:] = float("-inf")
    if _native_bitmask(logits):
        from kvserve.kernels.cpu import native

        # xgrammar's CPU kernel tests one bit at a time: ~9 ms for 32 rows of a 49k vocabulary,
        # as much as the rest of the sampler at batch 32 on the fast path; the native one ~0.3 ms.
        native.apply_token_bitmask(logits, mask, rows, manager.vocab_size)
        return
    xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=manager.vocab_size, indices=rows)


def _native_bitmask(logits: torch.Tensor) -> bool:
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1:
        return False
    from kvserve.kernels.cpu import native

    return native.available()


def apply_grammar_to_drafts(logits: torch.Tensor, state: GrammarState, drafts: list[int]) -> None:
    """Masks a verification span in place: row j (of len(drafts) + 1) gets the mask of the
    grammar state after drafts[:j]. The matcher walks the drafts and rolls back to where it was;
    a draft the grammar refuses leaves the rows after it unmasked (verification stops at that
    draft anyway: its masked probability is 0)."""
    import xgrammar as xgr

    if state.is_terminated:
        return
    mask = state.manager.bitmask(len(drafts) + 1)
    rows, walked = [], 0
    for j in range(len(drafts) + 1):
        state.matcher.fill_next_token_bitmask(mask, j)
        rows.append(j)
        if j == len(drafts) or not state.accept(drafts[j]):
            break
        walked += 1
        if state.is_terminated:
            break
    state.rollback(walked)
    if logits.device.type != "cpu":
        mask = mask.to(logits.device, non_blocking=True)
    vocab = state.manager.vocab_size
    if logits.shape[1] > vocab:
        logits[rows, vocab:] = float("-inf")
    xgr.apply_token_bitmask_inplace(logits, mask[: len(drafts) + 1], vocab_size=vocab, indices=rows)
