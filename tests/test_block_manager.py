from collections import Counter

import pytest

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.scheduler import Scheduler
from nanovllm.sequence import Sequence
from nanovllm.sampling_params import SamplingParams


def seq(tokens, max_tokens=4):
    return Sequence(list(tokens), SamplingParams(temperature=0, max_tokens=max_tokens))


def check_invariants(bm: BlockManager, live: list[Sequence]):
    holders = Counter(b for s in live for b in s.block_table)
    for block in bm.blocks:
        assert block.ref_count == holders.get(block.block_id, 0), block.block_id
        assert (block.block_id in bm.free_block_ids) == (block.ref_count == 0)
    for h, block_id in bm.hash_to_block_id.items():
        block = bm.blocks[block_id]
        assert block.hash == h and len(block.token_ids) == bm.block_size


def cached_seq(bm: BlockManager, tokens) -> Sequence:
    """A sequence whose tokens are all computed and whose full blocks are in the prefix cache."""
    s = seq(tokens)
    assert bm.allocate_slots(s, len(s))
    s.num_computed_tokens = len(s)
    bm.cache_full_blocks(s, len(s))
    return s


def test_allocate_and_free_returns_every_block():
    bm = BlockManager(10, 4)
    a, b = seq(range(9)), seq(range(100, 103))
    assert bm.allocate_slots(a, 9) and bm.allocate_slots(b, 3)
    assert len(a.block_table) == 3 and len(b.block_table) == 1
    check_invariants(bm, [a, b])
    assert not bm.allocate_slots(seq(range(30)), 30)  # 8 blocks needed, 6 free: refused, nothing taken
    assert bm.num_free_blocks == 6
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 10
    check_invariants(bm, [])


def test_shared_prefix_reuses_blocks_with_reference_counts():
    bm = BlockManager(10, 4)
    a = cached_seq(bm, range(10))  # blocks 0..1 full
    b = seq(list(range(8)) + [50, 51, 52])
    hits = bm.find_cached_blocks(b)
    assert hits == a.block_table[:2]
    assert bm.allocate_slots(b, 3, hits)
    assert b.block_table[:2] == hits and len(b.block_table) == 3
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    check_invariants(bm, [a, b])
    bm.free(a)
    check_invariants(bm, [b])
    bm.free(b)
    assert bm.num_free_blocks == 10
    # freed blocks keep their hash until reused: a third prompt still hits them
    c = seq(list(range(8)) + [7])
    assert bm.find_cached_blocks(c) == hits
    check_invariants(bm, [])


def test_exact_block_multiple_prompt_keeps_one_token_to_compute():
    bm = BlockManager(10, 4)
    cached_seq(bm, range(8))
    b = seq(list(range(8)))
    assert len(bm.find_cached_blocks(b)) == 1  # the last block would leave nothing to run


def test_hash_collision_is_rejected_by_the_token_check(monkeypatch):
    monkeypatch.setattr(BlockManager, "compute_hash", staticmethod(lambda tokens, prefix=-1: 1234))
    bm = BlockManager(10, 4)
    a = cached_seq(bm, range(9))
    assert bm.find_cached_blocks(seq([9, 9, 9, 9, 1])) == []  # same hash, other tokens
    assert bm.find_cached_blocks(seq([0, 1, 2, 3, 1])) == a.block_table[:1]


def test_eviction_reuses_freed_blocks_and_drops_their_hashes():
    bm = BlockManager(4, 4)
    bm.free(cached_seq(bm, range(16)))
    b = seq(list(range(100, 116)))
    assert bm.find_cached_blocks(b) == []
    assert bm.allocate_slots(b, 16)  # takes all four, evicting a's cache entries
    assert bm.hash_to_block_id == {}
    check_invariants(bm, [b])


@pytest.mark.parametrize("num_blocks,budget", [(6, 8), (20, 64), (5, 3)])
def test_scheduler_runs_everything_within_budget_and_frees_all(num_blocks, budget):
    bm = BlockManager(num_blocks, 4)
    sched = Scheduler(max_num_seqs=3, max_num_batched_tokens=budget, block_manager=bm)
    seqs = [seq(range(i, i + n), max_tokens=m) for i, (n, m) in enumerate([(7, 5), (3, 9), (12, 2), (5, 6), (1, 4)])]
    for s in seqs:
        sched.add(s)
    steps = 0
    while not sched.is_finished():
        scheduled = sched.schedule()
        assert scheduled and sum(n for _, n in scheduled) <= budget and len(sched.running) <= 3
        for s, n in scheduled:  # schedule() has counted the new tokens as computed
            assert len(s.block_table) * 4 >= s.num_computed_tokens
            bm.cache_full_blocks(s, len(s))
            if s.num_computed_tokens == len(s):
                s.token_ids.append(7)
                if s.num_completion_tokens == s.sampling_params.max_tokens:
                    sched.finish(s, "length")
        check_invariants(bm, sched.running)
        steps += 1
        assert steps < 500
    assert all(s.num_completion_tokens == s.sampling_params.max_tokens for s in seqs)
    assert bm.num_free_blocks == num_blocks


# ---- truncate: a sequence's tail dropped from its KV (a verify run cut after a wrong draft) ----------


def running_seq(bm: BlockManager, tokens, computed=None) -> Sequence:
    """A sequence holding blocks for all its tokens, the first `computed` (default: all) computed
    and registered in the prefix cache where full (as the engine does once their values are read)."""
    s = seq(tokens)
    assert bm.allocate_slots(s, len(s))
    s.num_computed_tokens = len(s) if computed is None else computed
    bm.cache_full_blocks(s, len(s))
    return s


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_truncate_inside_a_partial_block_frees_the_blocks_past_it(prefix_caching):
    bm = BlockManager(10, 4, prefix_caching)
    a = running_seq(bm, range(14))  # blocks: 3 full (0-11), 1 partial (12-13)
    held = list(a.block_table)
    bm.truncate(a, 6)  # inside block 1
    assert a.block_table == held[:2] and a.num_computed_tokens == 6
    assert bm.num_free_blocks == 8 and all(b in bm.free_block_ids for b in held[2:])
    assert a.num_hashed_blocks == (1 if prefix_caching else 0)  # block 0 holds only kept tokens
    if prefix_caching:  # block 0 stays cached; block 1 (kept, to be rewritten) and 2 (freed) leave the cache
        assert set(bm.hash_to_block_id.values()) == {held[0]}
        assert bm.blocks[held[1]].hash == -1 and bm.blocks[held[2]].hash == -1
    check_invariants(bm, [a])
    # the sequence goes on from token 6: new tokens, blocks allocated again, then cached again
    del a.token_ids[6:]
    a.token_ids += [70, 71, 72, 73, 74, 75]
    assert bm.allocate_slots(a, 6) and len(a.block_table) == 3
    a.num_computed_tokens = 12
    bm.cache_full_blocks(a, 12)
    check_invariants(bm, [a])
    if prefix_caching:
        assert a.num_hashed_blocks == 3
        b = seq(list(a.token_ids[:12]) + [1])
        assert bm.find_cached_blocks(b) == a.block_table[:3]  # the new tokens' blocks, not the dropped ones
        assert bm.find_cached_blocks(seq(list(range(12)) + [1])) == a.block_table[:1]
    bm.free(a)
    assert bm.num_free_blocks == 10
    check_invariants(bm, [])


def test_truncate_at_a_block_boundary_and_to_nothing():
    bm = BlockManager(10, 4)
    a = running_seq(bm, range(10))
    bm.truncate(a, 8)  # blocks 0-1 whole, block 2 (8-9) wholly past
    assert len(a.block_table) == 2 and a.num_computed_tokens == 8 and a.num_hashed_blocks == 2
    assert len(bm.hash_to_block_id) == 2  # the kept full blocks stay cached: they hold only kept tokens
    bm.truncate(a, 0)
    assert a.block_table == [] and a.num_computed_tokens == 0 and a.num_hashed_blocks == 0
    assert bm.num_free_blocks == 10 and bm.hash_to_block_id == {}
    check_invariants(bm, [])


def test_truncate_inside_a_full_hashed_block_it_alone_holds():
    bm = BlockManager(10, 4)
    a = running_seq(bm, range(12))  # 3 full blocks, all cached
    held = list(a.block_table)
    bm.truncate(a, 9)  # inside block 2, which a alone holds: kept, out of the cache
    assert a.block_table == held and a.num_computed_tokens == 9 and a.num_hashed_blocks == 2
    assert bm.blocks[held[2]].hash == -1 and held[2] not in bm.hash_to_block_id.values()
    assert bm.find_cached_blocks(seq(list(range(12)) + [5])) == held[:2]
    check_invariants(bm, [a])


def test_truncate_inside_a_shared_block_gives_it_back_and_recomputes_its_tokens():
    bm = BlockManager(10, 4)
    a = running_seq(bm, range(12))
    b = seq(list(range(12)) + [40, 41])
    hits = bm.find_cached_blocks(b)
    assert hits == a.block_table[:3] and bm.allocate_slots(b, 2, hits)
    b.num_computed_tokens = 14
    bm.truncate(b, 10)  # inside block 2, which a holds too: b must not write into it
    assert b.block_table == hits[:2] and b.num_computed_tokens == 8 and b.num_hashed_blocks == 2
    assert bm.blocks[hits[2]].ref_count == 1 and bm.blocks[hits[2]].hash != -1  # a's, still cached
    assert bm.find_cached_blocks(seq(list(range(12)) + [5])) == hits
    check_invariants(bm, [a, b])
    # b computes tokens 8.. again into a block of its own
    assert bm.allocate_slots(b, 2) and len(b.block_table) == 3 and b.block_table[2] != hits[2]
    check_invariants(bm, [a, b])


def test_truncate_keeps_computed_tokens_consistent():
    bm = BlockManager(10, 4)
    a = running_seq(bm, range(10), computed=7)  # the tokens past 7 are not computed yet
    bm.truncate(a, 9)
    assert a.num_computed_tokens == 7 and len(a.block_table) == 3  # nothing computed was dropped
    bm.truncate(a, 5)
    assert a.num_computed_tokens == 5 and len(a.block_table) == 2
    bm.free(a)  # what a preemption leaves: no blocks, nothing computed
    a.num_computed_tokens = 0
    bm.truncate(a, 3)
    assert a.block_table == [] and a.num_computed_tokens == 0 and bm.num_free_blocks == 10
    check_invariants(bm, [])


def test_scheduler_runs_drafts_whole_or_drops_them():
    bm = BlockManager(20, 4)
    sched = Scheduler(max_num_seqs=4, max_num_batched_tokens=8, block_manager=bm)
    a, b, c = seq(range(5), 10), seq(range(10, 13), 10), seq(range(20, 22), 10)
    for s in (a, b):
        sched.add(s)
    assert sched.schedule() == [(a, 5), (b, 3)] and sched.scheduled_drafts == {}
    for s in (a, b):
        s.token_ids.append(7)  # their first sampled tokens
    sched.add(c)
    sched.drafts = {a.seq_id: [1, 2, 3], b.seq_id: [4, 5, 6, 8, 9]}
    # after the decodes (1 + 1 of 8), a's 3 drafts fit and run with its token; b's 5 do not (3 left):
    # b decodes plainly and its drafts, which follow its current last token, are dropped; c gets the rest
    assert sched.schedule() == [(a, 4), (b, 1), (c, 2)]
    assert sched.scheduled_drafts == {a.seq_id: [1, 2, 3]} and sched.drafts == {}
    assert a.num_computed_tokens == 9 and len(a.block_table) == 3
    check_invariants(bm, [a, b, c])
    sched.drafts = {b.seq_id: [1], c.seq_id: [2]}
    sched.finish(b, "abort")
    assert sched.drafts == {c.seq_id: [2]}
    sched.abort_all()
    assert sched.drafts == {} and bm.num_free_blocks == 20
