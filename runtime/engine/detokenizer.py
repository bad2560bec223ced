"""Incremental detokenization with stop strings.

Decoding token by token is wrong for byte-level BPE (one character split over several tokens)
and for tokenizers that drop a word's leading space at the start of a decode. So each new token
is decoded together with a few preceding tokens (a "prefix window"); the new text is what that
window decodes to beyond the prefix alone, and it is only emitted once it no longer ends in an
incomplete character (U+FFFD). Emitted pieces therefore concatenate exactly to the final text.

Stop strings are matched as the text grows (an automaton over the stops, runtime/engine/stop_strings.py,
so each new character is read once whatever the number of stops); a suffix that could still grow
into a stop string is held back from ``visible_text`` until it can no longer match.

Without stop strings nothing the engine decides depends on the text, so the decoding is lazy:
tokens are queued and decoded when the text is read (the same operations in the same order, so
the same text). That lets the engine launch its next forward pass before it detokenizes the
tokens of the last one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvserve.runtime.engine.stop_strings import compile_stops

_PREFIX_WINDOW = 6
_REPLACEMENT = "\ufffd"


def make_decode_fn(tokenizer: Any) -> Callable[[list[int], bool], str]:
    """Fast path through the Rust tokenizer when there is one; same text either way, without the
    Python-side space cleanup (which would make window decodes disagree with whole decodes)."""
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if backend is not None and hasattr(backend, "decode"):
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip,
                                              clean_up_tokenization_spaces=False)


class IncrementalDetokenizer:
    def __init__(
        self,
        decode: Callable[[list[int], bool], str],
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._decode = decode
        self._skip = skip_special_tokens
        tail = list(prompt_token_ids[-_PREFIX_WINDOW:])
        self._ids = tail
        self._prefix_offset = 0
        self._read_offset = len(tail)
        self.stop = list(stop or [])
        self._stops = compile_stops(tuple(self.stop)) if self.stop else None
        self._stop_state = 0  # the automaton's node: the longest tail that may still become a stop
        self._include_stop = include_stop_str_in_output
        self._text = ""
        self.stop_reason: str | None = None
        self._lazy = not self.stop
        self._queued: list[int | None] = []  # lazy mode: token ids to add, None for a flush

    @property
    def output_text(self) -> str:
        self._catch_up()
        return self._text

    def add_token(self, token_id: int) -> str | None:
        """Adds one generated token; returns the stop string it completed, if any."""
        if self._lazy:
            self._queued.append(token_id)
            return None
        return self._add(token_id)

    def flush(self) -> str | None:
        """At the end of generation: emits whatever is pending, even an incomplete character."""
        if self._lazy:
            self._queued.append(None)
            return None
        return self._flush()

    def _catch_up(self) -> None:
        if self._queued:
            queued, self._queued = self._queued, []
            for token_id in queued:
                if token_id is None:
                    self._flush()
                else:
                    self._add(token_id)

    def _add(self, token_id: int) -> str | None:
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset], self._skip)
        new_text = self._decode(self._ids[self._prefix_offset:], self._skip)
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            self._append(new_text[len(prefix_text):])
            # Keep the window short: drop ids that can no longer affect the decode.
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            if self._prefix_offset > 64:
                cut = self._prefix_offset
                self._ids = self._ids[cut:]
                self._prefix_offset -= cut
                self._read_offset -= cut
        return self.stop_reason

    def _flush(self) -> str | None:
        if self.stop_reason is None and self._read_offset < len(self._ids):
            prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset], self._skip)
            new_text = self._decode(self._ids[self._prefix_offset:], self._skip)
            if len(new_text) > len(prefix_text):
                self._append(new_text[len(prefix_text):])
            self._read_offset = len(self._ids)
        return self.stop_reason

    def _append(self, piece: str) -> None:
        if self.stop_reason is not None:
            return
        offset = len(self._text)
        self._text += piece
        if self._stops is None:
            return
        self._stop_state, best = self._stops.scan(self._stop_state, piece, offset)
        if best is not None:
            idx, s = best
            self._text = self._text[: idx + len(s) if self._include_stop else idx]
            self.stop_reason = s

    def visible_text(self, finished: bool) -> str:
        """The text safe to show: without a tail that might still become a stop string."""
        text = self.output_text  # catches up a lazy detokenizer
        if finished or not self.stop or self.stop_reason is not None:
            return text
        held = self._stops.depth[self._stop_state]
        return text[:-held] if held else text
