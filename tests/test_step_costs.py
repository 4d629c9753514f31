"""What a step costs (server/step_costs.py): measured when an engine that speculates starts, kept per device by what
the engine is, read back only whole."""

from __future__ import annotations

import json
import logging

import pytest
from helpers import greedy_exact

from server import step_costs
from server.config import EngineConfig
from server.engine import Engine
from server.speculate import DraftCosts
from server.step_costs import CostCache

COSTS = DraftCosts((1, 2, 4), (0.010, 0.012, 0.015), 0.001, 0.002, (0.009, 0.011), 2e-6)
PROPOSER = DraftCosts((1, 2), (0.002, 0.003), decode=(0.002,))
LOOP = [11, 12, 13, 14, 15, 16, 17, 18]


@pytest.mark.unit
def test_kept_costs_read_back_whole_and_only_for_the_same_engine_device_and_sources(tmp_path, monkeypatch):
    engine = {"target": {"config": {"hidden_size": 64}, "dtype": "torch.float32"}, "kernels": ["rows"]}
    assert CostCache(tmp_path, "cpu", 2, engine).get() is None
    CostCache(tmp_path, "cpu", 2, engine).put(COSTS, None)
    CostCache(tmp_path, "cpu", 2, {**engine, "draft": 1}).put(COSTS, PROPOSER)
    assert CostCache(tmp_path, "cpu", 2, engine).get() == (COSTS, None)
    assert CostCache(tmp_path, "cpu", 2, {**engine, "draft": 1}).get() == (COSTS, PROPOSER)
    assert CostCache(tmp_path, "cpu", 2, {**engine, "kernels": ["gemm"]}).get() is None  # another engine
    assert CostCache(tmp_path, "cpu", 1, engine).get() is None  # another thread count: another device
    monkeypatch.setattr(step_costs, "source_digest", lambda: "changed")
    assert CostCache(tmp_path, "cpu", 2, engine).get() is None  # changed sources measure again


@pytest.mark.unit
def test_a_damaged_file_or_entry_is_measured_again_in_one_log_line(tmp_path, caplog):
    cache = CostCache(tmp_path, "cpu", 2, {"a": 1})
    cache.file.parent.mkdir(parents=True)
    cache.file.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="quantserve.engine"):
        assert cache.get() is None
    assert len(caplog.records) == 1 and "unreadable" in caplog.records[0].getMessage()
    cache.put(COSTS, None)  # a damaged file is replaced whole
    assert cache.get() == (COSTS, None)
    d = json.loads(cache.file.read_text())
    entry = d["entries"][cache.key]["target"]
    for bad in ({**entry, "rows": [2, 4, 8]}, {**entry, "seconds": [0.01, -1.0, 0.02]},
                {**entry, "decode": [0.1] * 5}, {**entry, "rows": [1, 2]}, {**entry, "attend": -1e-6},
                {k: v for k, v in entry.items() if k != "draw"}):
        d["entries"][cache.key]["target"] = bad
        cache.file.write_text(json.dumps(d))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="quantserve.engine"):
            assert cache.get() is None, bad
        assert len(caplog.records) == 1


@pytest.mark.unit
def test_costs_that_cannot_be_kept_are_served_in_one_log_line(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # the cache dir lies under a file: nothing can be written there
    cache = CostCache(blocker, "cpu", 2, {"a": 1})
    monkeypatch.setattr(step_costs, "measure", lambda *a, **kw: (COSTS, PROPOSER))
    with caplog.at_level(logging.WARNING, logger="quantserve.engine"):
        assert step_costs.costs(None, None, "cpu", cache=cache) == (COSTS, PROPOSER)
        cache.put(COSTS, PROPOSER)
    assert [r.getMessage().split(" in ")[0] for r in caplog.records] == ["could not keep step costs"]
    assert cache.get() is None and not cache.file.exists()


@pytest.mark.unit
def test_the_file_keeps_the_most_recently_measured_engines(tmp_path, monkeypatch):
    monkeypatch.setattr(step_costs, "MAX_ENTRIES", 3)
    for i in range(5):
        CostCache(tmp_path, "cpu", 2, {"engine": i}).put(COSTS, None)
    CostCache(tmp_path, "cpu", 2, {"engine": 2}).put(COSTS, None)  # measured again: now the newest
    kept = [i for i in range(5) if CostCache(tmp_path, "cpu", 2, {"engine": i}).get() is not None]
    assert kept == [2, 3, 4]


@pytest.mark.reference
def test_the_engine_measures_its_step_costs_once_keeps_them_and_gives_the_probe_block_back(tiny_model_dir, tmp_path,
                                                                                            monkeypatch):
    measured = []
    measure = step_costs.measure
    monkeypatch.setattr(step_costs, "measure", lambda *a, **kw: measured.append(1) or measure(*a, **kw))

    def engine(**kw) -> Engine:
        return Engine.from_path(str(tiny_model_dir), EngineConfig(**{
            **dict(memory_budget="2MiB", dtype="float32", speculate="ngram", speculate_tokens=5), **kw}), tmp_path)

    eng = engine()
    try:
        costs = eng.scheduler.draft_costs
        assert measured == [1]
        assert costs.rows[0] == 1 and len(costs.rows) >= 2 and list(costs.rows) == sorted(costs.rows)
        assert all(t > 0 for t in costs.seconds) and eng.scheduler.max_drafts == 5
        assert 0 < costs.draw and 0 < costs.filtered and costs.attend >= 0  # (rows over 512-token contexts)
        eng.pool.audit()
        assert eng.pool.used_blocks == 0
        c = eng.complete(LOOP * 6, greedy_exact(8))
        assert c.accounting.speculated_tokens <= 5 * 8
    finally:
        eng.close()
    again = engine()  # the same engine on the same device: the costs kept, no forward measured
    again.close()
    assert measured == [1] and again.scheduler.draft_costs == costs
    other = engine(dtype="bfloat16")  # another engine: measured
    other.close()
    assert measured == [1, 1]
