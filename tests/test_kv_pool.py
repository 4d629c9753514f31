"""The KV block pool: budget arithmetic, all-or-nothing reservations, immediate release."""

from __future__ import annotations

import pytest
import torch

from quant.memory import KNOWN_SHAPES, kv_bytes_per_token
from server.kv_pool import BlockPool, KVBudgetError, KVLayout, resolve_budget

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
