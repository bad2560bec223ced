"""Incremental detokenization: streamed pieces concatenate to the final text; stop strings."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.runtime.engine.detokenizer import IncrementalDetokenizer, make_decode_fn
from kvserve.testing.tinymodels import build_tokenizer

TEXTS = [
    "Hello world! How are you today?",
    "Café, naïve, résumé, 東京, Привет, emoji 🙂 — multi-byte text must survive decoding intact.",
    "東京東京🙂🙂 Привет",
    "def add(a, b): return a + b  # code",
    "  leading spaces and\nnewlines\n\n",
]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(512)


def stream(tok, prompt_ids, ids, **kw):
    decode = make_decode_fn(tok)
    d = IncrementalDetokenizer(decode, prompt_ids, **kw)
    shown, pieces, stop = "", [], None
    for t in ids:
        stop = d.add_token(t)
        text = d.visible_text(finished=stop is not None)
        assert text.startswith(shown)
        pieces.append(text[len(shown):])
        shown = text
        if stop is not None:
            break
    if stop is None:
        d.flush()
        text = d.visible_text(finished=True)
        pieces.append(text[len(shown):])
    return pieces, d


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_concatenate_to_the_decoded_text(tok, text):
    ids = tok.encode(text)
    assert len(ids) > len(text.encode()) // 4  # multi-byte characters span several tokens
    prompt = tok.encode("The quick brown fox")
    pieces, d = stream(tok, prompt, ids)
    assert "".join(pieces) == d.output_text == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.sampled_from("ab 東京🙂éП\n!"), min_size=1, max_size=30))
def test_any_text_round_trips_through_the_stream(tok, text):
    ids = tok.encode(text)
    pieces, _ = stream(tok, [], ids)
    assert "".join(pieces) == text


def test_stop_string_is_excluded_and_held_back(tok):
    text = "Hello world! How are you today?"
    ids = tok.encode(text)
    pieces, d = stream(tok, [], ids, stop=["How are"])
    assert "".join(pieces) == "Hello world! " and d.stop_reason == "How are"
    # nothing of "How" was ever shown before the match completed
    assert all("H" not in p for p in pieces[1:])
    pieces, d = stream(tok, [], ids, stop=["How are"], include_stop_str_in_output=True)
    assert "".join(pieces) == "Hello world! How are"


def test_multibyte_stop_string_and_partial_match_released(tok):
    text = "東京東京🙂🙂 Привет"
    ids = tok.encode(text)
    pieces, d = stream(tok, [], ids, stop=["🙂 П"])
    assert "".join(pieces) == "東京東京🙂"
    # a prefix of a stop string that never completes is released at the end
    pieces, d = stream(tok, [], tok.encode("abc Прив"), stop=["Привет"])
    assert "".join(pieces) == "abc Прив" and d.stop_reason is None


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("hi") + [tok.convert_tokens_to_ids("<|end|>")] + tok.encode(" there")
    skipped, _ = stream(tok, [], ids, skip_special_tokens=True)
    kept, _ = stream(tok, [], ids, skip_special_tokens=False)
    assert "".join(skipped) == "hi there"
    assert "".join(kept) == "hi<|end|> there"


@settings(max_examples=30, deadline=None)
@given(text=st.sampled_from(TEXTS), reads=st.lists(st.booleans(), min_size=1, max_size=80))
def test_lazy_decoding_reads_the_same_text_as_eager(tok, text, reads):
    """Without stop strings tokens are decoded when the text is read; whenever it is read, it is
    the text token-by-token decoding gives at that point."""
    decode = make_decode_fn(tok)
    ids = tok.encode(text, add_special_tokens=False)
    lazy = IncrementalDetokenizer(decode, [5, 6])
    eager = IncrementalDetokenizer(decode, [5, 6])
    eager._lazy = False
    assert lazy._lazy
    for t, read in zip(ids, reads * (len(ids) // len(reads) + 1)):
        assert lazy.add_token(t) is None and eager.add_token(t) is None
        if read:
            assert lazy.visible_text(False) == eager.visible_text(False)
    lazy.flush(), eager.flush()
    assert lazy.visible_text(True) == eager.visible_text(True) == eager.output_text
