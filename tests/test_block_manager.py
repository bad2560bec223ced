"""Block manager invariants under random operation sequences, plus copy-on-write by hand."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.runtime.engine.block_manager import BlockManager, NoFreeBlocksError

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("grow"), st.integers(0, 7), st.integers(1, 40)),
        st.tuples(st.just("fork"), st.integers(0, 7), st.integers(0, 7)),
        st.tuples(st.just("free"), st.integers(0, 7), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(1, 24), block_size=st.integers(1, 8), ops=OPS)
def test_random_ops_keep_invariants_and_free_everything(num_blocks, block_size, ops):
    bm = BlockManager(num_blocks, block_size)
    computed: dict[int, int] = {}  # seq -> tokens with slots
    for op, a, b in ops:
        if op == "grow":
            before = (list(bm.get_block_table(a)), bm.num_free_blocks)
            if bm.can_allocate(a, computed.get(a, 0), b):
                copies = bm.allocate_slots(a, computed.get(a, 0), b)
                computed[a] = computed.get(a, 0) + b
                assert len(bm.get_block_table(a)) == bm.blocks_for_tokens(computed[a])
                # every block written from now on is private to `a`
                first = (computed[a] - b) // block_size
                for blk in bm.get_block_table(a)[first:]:
                    assert bm.ref_counts[blk] == 1
                for src, dst in copies:
                    assert dst in bm.get_block_table(a) and src not in bm.get_block_table(a)
            else:
                with pytest.raises(NoFreeBlocksError):
                    bm.allocate_slots(a, computed.get(a, 0), b)
                assert (list(bm.get_block_table(a)), bm.num_free_blocks) == before
        elif op == "fork":
            if a != b and b not in bm.block_tables and a in bm.block_tables:
                bm.fork(a, b)
                computed[b] = computed[a]
        else:
            bm.free(a)
            computed.pop(a, None)
        bm.check_invariants()
        assert bm.num_free_blocks + bm.num_used_blocks == num_blocks
    for seq in list(bm.block_tables):
        bm.free(seq)
    bm.check_invariants()
    assert bm.num_free_blocks == num_blocks and not any(bm.ref_counts)


def test_copy_on_write_of_a_shared_partial_block():
    bm = BlockManager(8, 4)
    bm.allocate_slots(1, 0, 6)  # blocks for tokens 0..5: two blocks, the second half full
    parent = list(bm.get_block_table(1))
    bm.fork(1, 2)
    assert [bm.ref_counts[b] for b in parent] == [2, 2]
    copies = bm.allocate_slots(2, 6, 1)  # child writes token 6 into the shared second block
    assert copies == [(parent[1], bm.get_block_table(2)[1])]
    assert bm.get_block_table(2)[0] == parent[0]  # the full first block stays shared
    assert bm.ref_counts[parent[0]] == 2 and bm.ref_counts[parent[1]] == 1
    bm.free(1)
    bm.free(2)
    bm.check_invariants()
    assert bm.num_free_blocks == 8


def test_free_is_idempotent_and_ignores_unknown():
    bm = BlockManager(4, 2)
    bm.allocate_slots(7, 0, 3)
    bm.free(7)
    bm.free(7)
    bm.free(123)
    assert bm.num_free_blocks == 4


@pytest.mark.parametrize("field,args", [("num_blocks", (0, 4)), ("block_size", (4, 0))])
def test_bad_sizes(field, args):
    with pytest.raises(ValueError, match=field):
        BlockManager(*args)
