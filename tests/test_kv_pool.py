"""The KV block pool: budget arithmetic, all-or-nothing reservations, immediate release."""

from __future__ import annotations

import pytest
import torch

from quant.shape.memory import kv_bytes_per_token
from quant.shape.model import KNOWN_SHAPES
from server.kv_pool import BlockPool, KVBudgetError, KVLayout, resolve_budget

pytestmark = pytest.mark.unit

SMOL = KVLayout(layers=30, kv_heads=3, head_dim=64, dtype=torch.bfloat16, block_size=16)


def test_layout_matches_the_memory_model():
    assert SMOL.bytes_per_token == kv_bytes_per_token(KNOWN_SHAPES["135M"], torch.bfloat16) == 23040
    assert SMOL.bytes_per_block == 16 * 23040
    assert SMOL.blocks_for(1) == 1 and SMOL.blocks_for(16) == 1 and SMOL.blocks_for(17) == 2


def test_pool_storage_is_the_budget_rounded_down_to_blocks():
    pool = BlockPool(SMOL, budget_bytes=10 * SMOL.bytes_per_block + 123)
    assert pool.num_blocks == 10 and pool.capacity_tokens == 160
    assert pool.storage.numel() * pool.storage.element_size() == pool.capacity_bytes == 10 * SMOL.bytes_per_block


def test_reservations_are_all_or_nothing_and_release_is_immediate():
    pool = BlockPool(SMOL, 10 * SMOL.bytes_per_block, allocate=False)
    a = pool.try_reserve("a", 100)  # 7 blocks
    assert len(a) == 7 and pool.free_blocks == 3
    assert pool.try_reserve("b", 64) is None  # needs 4: nothing is taken
    assert pool.free_blocks == 3
    b = pool.try_reserve("b", 48)
    assert len(b) == 3 and set(a).isdisjoint(b) and pool.free_blocks == 0
    assert pool.release("a") == 7 and pool.free_blocks == 7
    assert pool.release("a") == 0  # twice is harmless
    assert pool.try_reserve("c", 112) is not None and pool.used_blocks == 10
    pool.release("b")
    pool.release("c")
    assert pool.stats()["used_bytes"] == 0 and pool.stats()["requests"] == 0


def test_can_ever_fit_and_double_reservation():
    pool = BlockPool(SMOL, 4 * SMOL.bytes_per_block, allocate=False)
    assert pool.can_ever_fit(64) and not pool.can_ever_fit(65)
    pool.try_reserve("x", 1)
    with pytest.raises(ValueError, match="already holds"):
        pool.try_reserve("x", 1)


def test_budget_too_small_is_an_error_with_the_numbers():
    with pytest.raises(KVBudgetError, match=r"holds no block of 16 tokens \(368640 bytes\)"):
        BlockPool(SMOL, SMOL.bytes_per_block - 1)


def test_resolve_budget():
    assert resolve_budget("2GiB") == 2 * 2**30
    assert resolve_budget(1024) == 1024
    frac = resolve_budget("0.01")
    assert 0 < frac < 2**40
    for bad in ("-5", "0", "lots", "1.5GiBs"):
        with pytest.raises(KVBudgetError, match="--memory-budget"):
            resolve_budget(bad)


# ---------------------------------------------------------------------------------------------- the prefix cache

TINY = KVLayout(layers=1, kv_heads=1, head_dim=4, dtype=torch.float32, block_size=4)


def _pool(blocks: int, **kw) -> BlockPool:
    return BlockPool(TINY, blocks * TINY.bytes_per_block, allocate=False, **kw)


def test_a_published_prefix_is_mapped_not_taken_and_the_last_tokens_block_is_always_own():
    pool = _pool(16)
    prompt = list(range(10))  # blocks [0..3] [4..7], then 2 tokens
    a = pool.try_reserve("a", 14, prompt)  # 4 blocks, none cached yet
    assert pool.hit_blocks("a") == 0 and len(a) == 4
    assert pool.publish("a", 8) == 2  # its prefill wrote 8 tokens: two full blocks keyed
    b = pool.try_reserve("b", 14, prompt)
    assert b[:2] == a[:2] and set(b[2:]).isdisjoint(a) and pool.hit_blocks("b") == 2
    assert pool.used_blocks == 6 and pool.shared_blocks("a") == 2 and pool.shared_blocks("b") == 2
    # A prompt ending on a block boundary: its last block holds the last token and is never mapped.
    c = pool.try_reserve("c", 9, prompt[:8])
    assert c[:1] == a[:1] and c[1] not in a and pool.hit_blocks("c") == 1
    assert pool.try_reserve("d", 4, prompt[:4]) is not None and pool.hit_blocks("d") == 0
    # Another salt (another model, KV dtype, adapter) shares nothing.
    other = _pool(16, salt="another model")
    other.try_reserve("a", 14, prompt)
    other.publish("a", 8)
    assert pool._chain(prompt) != other._chain(prompt)
    pool.audit()


def test_released_blocks_stay_cached_until_their_space_is_needed_then_lru():
    pool = _pool(6)
    p, q = [1] * 9, [2] * 9
    pool.try_reserve("p", 9, p)
    pool.publish("p", 9)
    pool.release("p")
    assert pool.cached_blocks == 2 and pool.free_blocks == 6 and pool.used_blocks == 0
    pool.try_reserve("q", 9, q)
    pool.publish("q", 9)
    pool.release("q")
    assert pool.cached_blocks == 4
    assert pool.cached_prefix(p) == 2 and pool.cached_prefix(q) == 2
    # A hit on p's prefix takes its two cached blocks back (never evicted for the request mapping them); its 3 fresh
    # blocks are the 2 free ones, then the least recently released cached block: q's deepest.
    assert pool.try_reserve("p2", 20, p) is not None and pool.hit_blocks("p2") == 2
    assert pool.evictions == 1 and pool.cached_blocks == 1 and pool.free_blocks == 1
    assert pool.cached_prefix(q) == 1  # q's chain lost its last block first: its first is still mapped
    pool.audit()


def test_a_held_block_is_never_evicted_and_a_full_pool_takes_nothing():
    pool = _pool(4)
    prompt = list(range(13))
    pool.try_reserve("a", 16, prompt)
    pool.publish("a", 12)
    assert pool.try_reserve("b", 5) is None  # every block held: nothing evicted, nothing taken
    assert pool.free_blocks == 0 and pool.evictions == 0
    b = pool.try_reserve("b", 16, prompt)  # 3 mapped, 1 fresh: still too many (no free block)
    assert b is None and pool.hit_blocks("b") == 0
    pool.audit()


def test_two_requests_prefilling_the_same_prompt_at_once_keep_one_key():
    pool = _pool(8)
    prompt = list(range(9))
    a = pool.try_reserve("a", 9, prompt)
    b = pool.try_reserve("b", 9, prompt)  # admitted before a published anything: no hit
    assert pool.publish("a", 9) == 2 and pool.publish("b", 9) == 0  # b's copies stay its own
    pool.release("b")
    assert pool.cached_blocks == 0 and pool.free_blocks == 5  # freed, not cached
    pool.release("a")
    assert pool.cached_blocks == 2 and a and b
    pool.audit()


def test_without_the_prefix_cache_nothing_is_shared():
    pool = _pool(8, prefix_cache=False)
    prompt = list(range(9))
    pool.try_reserve("a", 9, prompt)
    assert pool.publish("a", 9) == 0
    pool.try_reserve("b", 9, prompt)
    assert pool.hit_blocks("b") == 0 and pool.used_blocks == 6
    pool.release("a")
    pool.release("b")
    assert pool.cached_blocks == 0 and pool.free_blocks == 8
    pool.audit()


def test_audit_names_a_leaked_reference_and_a_freed_block_still_keyed():
    pool = _pool(4)
    pool.try_reserve("a", 9, list(range(9)))
    pool.publish("a", 9)
    pool._refs[0] += 1
    with pytest.raises(ValueError, match="references counted"):
        pool.audit()
    pool._refs[0] -= 1
    pool.release("a")
    b = next(iter(pool._cached))
    del pool._cached[b]
    pool._free.append(b)
    with pytest.raises(ValueError, match=f"free block {b} is still keyed"):
        pool.audit()


def test_random_traffic_keeps_the_books_and_maps_only_what_was_written():
    """Seeded random reservations, prefills and releases over prompts that share prefixes: after every operation
    the pool's books equal a recount; a mapped block holds exactly the tokens the mapping request's prompt has
    there (a stand-in storage records what each block was written with); every reservation is all or nothing."""
    import random

    rng = random.Random(0)
    pool = _pool(24)
    written: dict[int, tuple] = {}  # block -> the tokens its writer put there
    live: dict[str, list[int]] = {}
    stems = [[rng.randrange(5) for _ in range(12)] for _ in range(3)]
    def prefill(rid: str, upto: int) -> None:  # its prefill writes its own blocks, then publishes the full ones
        prompt, table = live[rid], pool.blocks_of(rid)
        for i in range(pool.hit_blocks(rid), upto // 4):
            written[table[i]] = tuple(prompt[i * 4:(i + 1) * 4])
        pool.publish(rid, upto)

    for step in range(600):
        r = rng.random()
        if live and r < 0.25:
            rid = rng.choice(sorted(live))
            prefill(rid, rng.randrange(len(live[rid]) + 1))
        elif live and r < 0.55:
            rid = rng.choice(sorted(live))
            prefill(rid, len(live[rid]))
            live.pop(rid)
            pool.release(rid)
        else:
            prompt = rng.choice(stems)[: rng.randrange(1, 13)] + [rng.randrange(5) for _ in range(rng.randrange(4))]
            before = (pool.free_blocks, pool.used_blocks)
            rid = f"r{step}"
            table = pool.try_reserve(rid, len(prompt) + rng.randrange(1, 6), prompt)
            if table is None:
                assert (pool.free_blocks, pool.used_blocks) == before
            else:
                live[rid] = prompt
                for i in range(pool.hit_blocks(rid)):
                    assert written[table[i]] == tuple(prompt[i * 4:(i + 1) * 4])
        pool.audit()
    assert pool.hit_tokens > 0 and pool.evictions > 0


INT4 = KVLayout(layers=30, kv_heads=3, head_dim=64, dtype=torch.bfloat16, block_size=32, kv_format="int4")


def test_an_int4_pool_is_its_units_and_counts_a_tail_as_two_blocks():
    assert INT4.tail_blocks == 2 and SMOL.tail_blocks == 0
    assert INT4.bytes_per_token == 30 * 3 * (64 + 4 + 8)  # codes, each value's scale and minimum, the keys' per block
    pool = BlockPool(INT4, 10 * INT4.bytes_per_block + 5)
    assert pool.storage.dtype == torch.uint8 and pool.scales is None
    assert pool.storage.numel() == pool.capacity_bytes == 10 * INT4.bytes_per_block  # the budget, nothing beside it


def test_an_int4_request_takes_its_tail_with_its_blocks_and_gives_both_back():
    pool = BlockPool(INT4, 10 * INT4.bytes_per_block, allocate=False)
    a = pool.try_reserve("a", 40)  # 2 blocks and a tail of 2
    assert len(a) == 2 and len(pool.tail_of("a")) == 2 and pool.held_blocks("a") == 4 and pool.free_blocks == 6
    assert set(a).isdisjoint(pool.tail_of("a"))
    assert pool.try_reserve("b", 140) is None  # 5 blocks + 2: nothing is taken
    assert pool.free_blocks == 6
    assert pool.try_reserve_group(["c", "c/1"], 40, list(range(40))) is None  # 2 + 1 (one shared) + 2 tails = 7
    assert pool.try_reserve_group(["c", "c/1"], 20, list(range(20))) is not None  # 1 + 1 + 2 tails = 6
    assert not pool.can_ever_fit(9 * 32) and pool.can_ever_fit(8 * 32)
    pool.audit()
    assert pool.free_blocks == 0
    assert not pool.grow("a", 65)  # a third block: none free
    assert pool.release("a") == 4 and pool.free_blocks == 4
    pool.release("c"), pool.release("c/1")
    pool.audit()
    assert pool.used_blocks == 0 and pool.free_blocks == 10
