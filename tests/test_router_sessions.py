"""The router's session table (pure): which conversations each pod keeps, continued, moved,
expired and bounded."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvserve.runtime.router.policy import chat_text, chunk_hashes
from kvserve.runtime.router.sessions import SessionTable


def turns(n: int, c: int = 0) -> list[list[int]]:
    """A chat's requests, turn by turn: each one's chunk hashes extend the one before."""
    messages = [{"role": "system", "content": "be brief " * 10}]
    out = []
    for t in range(n):
        messages.append({"role": "user", "content": f"conversation {c} turn {t}: " + "words " * 20})
        out.append(chunk_hashes(chat_text(messages)))
        messages.append({"role": "assistant", "content": "an answer " * 5})
    return out


def test_a_conversation_is_one_session_and_moves_with_its_turns():
    table = SessionTable()
    first, second, third = turns(3)
    table.record(first, "a", now=0)
    assert table.counts(["a", "b"], now=1) == {"a": 1, "b": 0}
    assert table.continued(second) == first[-1]
    assert table.counts(["a", "b"], now=1, own=table.continued(second)) == {"a": 0, "b": 0}  # its own does not count
    table.record(second, "a", now=1)
    assert len(table) == 1
    table.record(third, "b", now=2)  # the conversation moved: it counts where it went
    assert table.counts(["a", "b"], now=2) == {"a": 0, "b": 1}


def test_conversations_sharing_a_system_prompt_are_separate_sessions():
    table = SessionTable()
    for c in range(4):
        table.record(turns(1, c)[0], "a", now=c)
    assert table.counts(["a"], now=4) == {"a": 4}
    assert table.continued(turns(2, 5)[1]) is None  # another conversation's turn continues none of them


def test_sessions_expire_and_forget():
    table = SessionTable(ttl=10)
    table.record(turns(1, 0)[0], "a", now=0)
    table.record(turns(1, 1)[0], "b", now=5)
    assert table.counts(["a", "b"], now=10) == {"a": 1, "b": 1}
    assert table.counts(["a", "b"], now=10.5) == {"a": 0, "b": 1}
    table.forget("b")
    assert table.counts(["a", "b"], now=11) == {"a": 0, "b": 0} and len(table) == 0


@given(st.lists(st.tuples(st.integers(0, 30), st.sampled_from("abc")), max_size=200), st.integers(1, 8))
def test_memory_is_bounded_and_counts_add_up(requests, capacity):
    table = SessionTable(ttl=1e9, capacity=capacity)
    for now, (prompt, pod) in enumerate(requests):
        table.record(chunk_hashes(f"prompt {prompt} " * 10), pod, now)
        counts = table.counts("abc", now)
        assert len(table) <= capacity and sum(counts.values()) == len(table)


@pytest.mark.parametrize("kw, field", [({"ttl": 0}, "ttl"), ({"capacity": 0}, "capacity")])
def test_bad_arguments_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SessionTable(**kw)
