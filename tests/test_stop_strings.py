"""The stop-string automaton against the plain search it replaces (the same stop, the same place,
the same held-back tail), and its cost following the new text rather than the stops."""

from __future__ import annotations

import gc
import time
import weakref

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.runtime.engine.detokenizer import IncrementalDetokenizer
from kvserve.runtime.engine.stop_strings import StopAutomaton, compile_stops


def reference(stops: list[str], pieces: list[str]) -> tuple[str, str | None, list[str]]:
    """The search the detokenizer did before: every stop searched in the recent text after each
    piece, the earliest start wins (the first listed on a tie); the held-back tail is the longest
    suffix that some stop starts with. Returns (text up to the stop, stop, visible text per piece)."""
    max_len = max(len(s) for s in stops)
    text, visible = "", []
    for piece in pieces:
        start = max(0, len(text) - max_len + 1)
        text += piece
        best = None
        for s in stops:
            idx = text.find(s, start)
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is not None:
            return text[:best[0]], best[1], visible
        shown = text
        for k in range(min(max_len - 1, len(text)), 0, -1):
            if any(s.startswith(text[-k:]) for s in stops):
                shown = text[:-k]
                break
        visible.append(shown)
    return text, None, visible


def run(stops: list[str], pieces: list[str]) -> tuple[str, str | None, list[str]]:
    automaton = StopAutomaton(tuple(stops))
    state, text, visible = 0, "", []
    for piece in pieces:
        offset = len(text)
        text += piece
        state, hit = automaton.scan(state, piece, offset)
        if hit is not None:
            return text[:hit[0]], hit[1], visible
        held = automaton.depth[state]
        visible.append(text[:-held] if held else text)
    return text, None, visible


@pytest.mark.parametrize("stops, pieces, expected_text, expected_stop", [
    (["abc", "bc"], ["xabcd"], "x", "abc"),           # earliest start wins over earliest end
    (["bc", "abc"], ["xa", "bc"], "x", "abc"),
    (["abc", "ab"], ["abc"], "", "abc"),              # same start: the first listed
    (["ab", "abc"], ["abc"], "", "ab"),
    (["ab", "ab"], ["zab"], "z", "ab"),               # duplicates
    (["END"], ["the E", "N", "D more"], "the ", "END"),  # across pieces
    (["aab"], ["aaaa", "ab"], "aaa", "aab"),         # failure links: the match restarts inside a run
    (["東京"], ["in 東", "京!"], "in ", "東京"),
    (["x"], ["abc"], "abc", None),
])
def test_table(stops, pieces, expected_text, expected_stop):
    assert run(stops, pieces)[:2] == (expected_text, expected_stop)
    assert run(stops, pieces) == reference(stops, pieces)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(alphabet="abc東", min_size=1, max_size=5), min_size=1, max_size=6),
       st.lists(st.text(alphabet="abc東", max_size=6), max_size=12))
def test_same_as_the_plain_search(stops, pieces):
    assert run(stops, pieces) == reference(stops, pieces)


def test_automata_are_shared_while_held_and_not_kept_after():
    held = compile_stops(("a", "b"))
    assert compile_stops(("a", "b")) is held
    ref = weakref.ref(held)
    del held
    gc.collect()
    assert ref() is None


def test_many_long_stops_cost_per_character_not_per_stop():
    """64 stops of 1,000 characters, none of which the text ever starts: the plain search tried
    every stop against every candidate tail after each token (21 s for these 2,000 tokens on a
    busy 2-core machine); the automaton reads each new character once (milliseconds)."""
    stops = [chr(0x4E00 + i) * 1000 for i in range(64)]
    decode = lambda ids, skip: "".join("a" if t else "b" for t in ids)  # noqa: E731
    d = IncrementalDetokenizer(decode, [0], stop=stops)
    t0 = time.perf_counter()
    for _ in range(2_000):
        assert d.add_token(1) is None
        d.visible_text(False)
    elapsed = time.perf_counter() - t0
    assert d.visible_text(False) == "a" * 2_000
    assert elapsed < 1.0, elapsed
