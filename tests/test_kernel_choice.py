"""Kernel choice per CPU (quant/runtime/kernel_choice.py): every path of every runtime module equals its reference, the
plan picks what it measured and is cached per CPU, the int4pack layout reads back on every vector width, and the
engine reports what it chose."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import greedy_exact
from torch import nn

from quant.build import gptq as G
from quant.runtime import int4
from quant.runtime import kernel_choice as KC
from quant.runtime.int8 import Int8WeightLinear
from quant.runtime.kernels import dequant, gemm, rows
from quant.runtime.w8a8 import W8A8Linear

ROOT = Path(__file__).resolve().parents[1]


def _linear(k=128, n=96, bias=True, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(k, n, bias=bias)


def _modules():
    lin = _linear()
    gptq = int4.GPTQLinear.from_quantized(G.rtn(lin.weight.data, 4, 64), lin.bias.data, v2=False)
    gptq.prepare(torch.bfloat16)
    return {
        "int8-sym": Int8WeightLinear.from_float(lin, affine=False),
        "int8-affine": Int8WeightLinear.from_float(_linear(seed=1), affine=True),
        "w8a8-static": W8A8Linear.from_float(lin, input_scale=0.03, smooth_scale=torch.rand(128) + 0.5),
        "w8a8-dynamic": W8A8Linear.from_float(lin, input_scale=None),
        "int4pack": gptq,
    }


@pytest.mark.reference
@pytest.mark.parametrize("name", list(_modules()))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_path_matches_the_reference(name, dtype):
    m = _modules()[name]
    m.prepare(dtype)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(2)).to(dtype)
    ref = m.reference_forward(x)
    paths = m.paths(dtype)
    assert len(paths) >= (2 if dtype == torch.bfloat16 else 1)
    for path, fn in paths.items():
        y = fn(x)
        assert y.dtype == dtype and y.shape == (5, 96), path
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
        assert float((y.float() - ref).abs().max() / ref.abs().max()) < tol, path


@pytest.mark.unit
def test_a_plan_routes_each_row_count_to_its_path(monkeypatch):
    m = _modules()["int8-sym"]
    m.prepare(torch.bfloat16)
    assert KC.ROW_BUCKETS[:3] == (1, 4, 8)
    plan = KC.RowPlan(("kernel", "kernel") + ("dequant-fp32",) * (len(KC.ROW_BUCKETS) - 2), {})
    m.use_plan(plan, torch.bfloat16)
    calls = []
    real = torch.ops.aten._weight_int8pack_mm
    monkeypatch.setattr(torch.ops.aten, "_weight_int8pack_mm", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for n in (1, 4, 5, 600):
        m(torch.randn(n, 128, dtype=torch.bfloat16))
    assert calls == [1, 4]  # 5 rows is in the 8-row bucket; 600 above the last one uses the last bucket's path
    assert m.kernel_runs(4, torch.bfloat16) and not m.kernel_runs(5, torch.bfloat16)
    assert plan.describe() == "kernel <= 4 rows, dequant-fp32 above 4"


@pytest.mark.unit
def test_plan_pick_and_describe():
    assert KC.ROW_BUCKETS == (1, 4, 8, 16, 64, 256, 512)
    p = KC.RowPlan(("a",) * 7, {})
    assert p.single == "a" and p.describe() == "a at every row count"
    p = KC.RowPlan(("a", "b", "b", "b", "a", "a", "a"), {})
    assert [p.pick(r) for r in (1, 2, 4, 5, 16, 17, 512, 5000)] == ["a", "b", "b", "b", "b", "a", "a", "a"]
    assert p.describe() == "a <= 1 rows, b <= 16 rows, a above 16"


@pytest.mark.unit
def test_measure_picks_the_faster_path_per_bucket_and_drops_only_slow_calls():
    def slow(x):
        time.sleep(0.006)
        return x

    def fixed_cost(x):  # like dequantizing: slower at few rows, faster at many
        time.sleep(0.0015 if x.shape[0] < 100 else 0.0002)
        return x

    def per_row(x):
        time.sleep(0.0002 if x.shape[0] < 100 else 0.003)
        return x

    plan = KC.measure({"slow": slow, "fixed": fixed_cost, "per_row": per_row}, 16, torch.float32)
    assert plan.paths == tuple("per_row" if rows < 100 else "fixed" for rows in KC.ROW_BUCKETS)
    assert plan.us["slow"][0] > 5000 and plan.us["slow"][1:] == (None,) * (len(KC.ROW_BUCKETS) - 1)
    assert all(v is not None for v in plan.us["fixed"])


@pytest.mark.unit
def test_a_plan_bounded_in_rows_is_measured_no_further_and_kept_apart(tmp_path):
    seen = []

    def path(x):
        seen.append(x.shape[0])
        return x

    plan = KC.measure({"a": path, "b": lambda x: x + 0}, 16, torch.float32, max_rows=10)
    assert max(seen) == 16  # the bucket that holds 10 rows, none above it
    i = KC.ROW_BUCKETS.index(16)
    assert plan.paths[i + 1 :] == (plan.paths[i],) * (len(KC.ROW_BUCKETS) - i - 1)
    assert plan.us["a"][i + 1 :] == (None,) * (len(KC.ROW_BUCKETS) - i - 1)
    # a head's plan (<= 64 rows) is stored apart from the same computation measured at every bucket
    c = KC.Chooser("measure", tmp_path)
    c.plan("k", {"a": path, "b": lambda x: x + 0}, 16, torch.float32, "cpu", max_rows=64)
    c.plan("k", {"a": path, "b": lambda x: x + 0}, 16, torch.float32, "cpu")
    assert sorted(c.chosen) == ["k", "k (<= 64 rows)"]
    assert max(seen) == max(KC.ROW_BUCKETS)


@pytest.mark.unit
def test_plans_are_cached_per_cpu_and_a_damaged_file_is_measured_again(tmp_path, monkeypatch):
    paths = {"a": lambda x: x, "b": lambda x: x + 0}
    first = KC.Chooser("measure", tmp_path).plan("k", paths, 16, torch.float32, torch.device("cpu"))
    files = list((tmp_path / "kernel-plans").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["device"] == KC.cpu_key()

    measured = []

    def measuring(*a, **k):
        measured.append(1)
        raise RuntimeError("measured")  # the chooser falls back to the rule (None)

    monkeypatch.setattr(KC, "measure", measuring)
    again = KC.Chooser("measure", tmp_path)
    assert again.plan("k", paths, 16, torch.float32, torch.device("cpu")) == first
    assert again.table() == [f"k: {first.describe()}"] and not measured
    # A stored plan naming a path this module does not offer is not trusted; nor is a damaged file.
    stored = json.loads(files[0].read_text())
    stored["plans"]["k"]["paths"] = ["b"] * len(KC.ROW_BUCKETS)
    files[0].write_text(json.dumps(stored))
    assert KC.Chooser("measure", tmp_path).plan("k", {"a": paths["a"], "c": paths["b"]}, 16, torch.float32,
                                                "cpu") is None
    assert len(measured) == 1
    files[0].write_text("{not json")
    assert KC.Chooser("measure", tmp_path).plan("k", paths, 16, torch.float32, torch.device("cpu")) is None
    assert len(measured) == 2


@pytest.mark.unit
def test_static_mode_measures_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(KC, "measure", lambda *a, **k: pytest.fail("measured in static mode"))
    c = KC.Chooser("static", tmp_path)
    assert c.plan("k", {"a": lambda x: x, "b": lambda x: x}, 16, torch.float32, "cpu") is None
    assert not (tmp_path / "kernel-plans").exists()
    with pytest.raises(ValueError, match="kernels must be one of measure, static"):
        KC.Chooser("fastest")


@pytest.mark.e2e
@pytest.mark.parametrize("capability", ["avx2", "default", None])
def test_int4pack_layout_reads_back_on_every_vector_width(capability):
    """The CPU int4pack layout depends on the vector width PyTorch dispatches to; each is checked in its own
    process (ATEN_CPU_CAPABILITY is read once), on shapes with full and partial blocks, against the codes read
    back through the kernel itself; the C++ dequantizer and int8 kernels, built for that capability, are held to
    their references bit for bit there."""
    native_ops = bool(dequant.load() and rows.available(torch.empty(0, dtype=torch.int8)))
    code = (
        "import torch\n"
        "from quant.build import gptq as G\n"
        "from quant.runtime import int4\n"
        "from quant.runtime.kernels import dequant, int4_layout, rows\n"
        "from quant.runtime.w8a8 import W8A8Linear\n"
        f"NATIVE = {native_ops}  # the C++ ops build in this test's process: then they must under the cap too\n"
        "assert not NATIVE or (dequant.load() and rows.available(torch.empty(0, dtype=torch.int8)))\n"
        "assert int4_layout.cpu_layout() is not None, torch.backends.cpu.get_cpu_capability()\n"
        "for n in (16, 48, 80, 576, 960):\n"
        "    w = torch.randn(n, 128, generator=torch.Generator().manual_seed(n))\n"
        "    m = int4.GPTQLinear.from_quantized(G.rtn(w, 4, 64), None, v2=False)\n"
        "    ref = m.dequantized(torch.float32)\n"
        "    m.prepare(torch.bfloat16)\n"
        "    fast = int4_layout.kernel_codes_cpu(m.packed, n, 128, int4_layout.cpu_layout()).to(torch.int32)\n"
        "    assert torch.equal(fast, m._kernel_codes()), n\n"
        "    err = (m.dequantized(torch.float32) - ref).abs().max() / ref.abs().max()\n"
        "    assert err < 1e-2, (n, err)  # scales and zeros are held in bf16\n"
        "    x = torch.randn(2, 128).bfloat16()\n"
        "    if NATIVE:  # the int4 rows kernel, built for this capability\n"
        "        y, r = m.paths(torch.bfloat16)['rows'](x).float(), m.reference_forward(x)\n"
        "        assert float((y - r).abs().max() / r.abs().max()) < 1e-2, n\n"
        "    sz = m.scales_zeros.clone()\n"
        "    sz[0, :3, 0] = torch.tensor([float('nan'), float('inf'), 1e-3])  # specials through the rounding\n"
        "    for dt in (torch.float32, torch.bfloat16):  # the C++ dequantizer as built for this capability\n"
        "        fast = dequant.int4pack(m.packed, n, 128, int4_layout.cpu_layout(), sz, 64, None, dt)\n"
        "        ref = dequant.int4pack_reference(m.packed, n, 128, int4_layout.cpu_layout(), sz, 64, None, dt)\n"
        "        torch.testing.assert_close(fast, ref, rtol=0, atol=0, equal_nan=True)  # NaN payloads aside\n"
        "w = W8A8Linear.from_float(torch.nn.Linear(200, 98), None)\n"
        "x = torch.randn(3, 200).bfloat16()\n"
        "xq, xs = w._quantize_input(x)\n"
        "exact = w._finish((xq.long() @ w.weight.long().t()).int(), xs, x.dtype)\n"
        "assert not NATIVE or torch.equal(w.paths(x.dtype)['rows'](x), exact)\n"
        "print(torch.backends.cpu.get_cpu_capability())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("ATEN_CPU_CAPABILITY", None)
    if capability:
        env["ATEN_CPU_CAPABILITY"] = capability
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    if capability:
        assert p.stdout.strip() == capability.upper()


@pytest.mark.reference
def test_dense_paths_agree():
    lin = _linear()
    w, b = lin.weight.data.bfloat16(), lin.bias.data.bfloat16()
    x = torch.randn(7, 128).bfloat16()
    paths = KC.dense_paths(w, b, torch.bfloat16)
    want = {"dense", "dense-fp32"} | ({"rows"} if rows.available(w) else set())
    if gemm.available(w, *w.shape, torch.bfloat16, dense=True):  # CPUs without AVX512-BF16 (AVX2-only ones)
        want.add("gemm")
    assert set(paths) == want
    ref = torch.nn.functional.linear(x.float(), w.float(), b.float())
    for fn in paths.values():
        assert float((fn(x).float() - ref).abs().max() / ref.abs().max()) < 1e-2
    w32, b32, x32 = lin.weight.data, lin.bias.data, torch.randn(7, 128)
    paths = KC.dense_paths(w32, b32, torch.float32)
    assert set(paths) == {"dense"} | ({"rows"} if rows.available(w32) else set())
    ref = torch.nn.functional.linear(x32.double(), w32.double(), b32.double())
    for fn in paths.values():  # fp32 sums in either order
        assert float((fn(x32).double() - ref).abs().max() / ref.abs().max()) < 1e-5


@pytest.mark.e2e
def test_engine_reports_its_measured_plans_and_refuses_an_unknown_mode(tiny_model_dir, tmp_path, text_file,
                                                                      monkeypatch, caplog):
    from conftest import run_cli

    from server.config import EngineConfig
    from server.engine import Engine

    art = tmp_path / "int8"
    assert run_cli("build", "--model", tiny_model_dir, "--scheme", "int8-sym", "--calib", text_file,
                   "--calib-samples", "2", "--calib-seqlen", "32", "--no-progress", "--out", art) == 0
    cfg = dict(memory_budget="2MiB", dtype="bfloat16", max_prefill_tokens=64)
    eng = Engine.from_path(str(art), EngineConfig(kernels="measure", **cfg), tmp_path)
    try:
        # the plans, then (where the one-row path is a rows pass with epilogues) what the projections fuse
        kernels = [k for k in eng.info.kernels if not k.startswith(("gate_up of ", "o and down: "))]
        assert kernels and all(k.startswith("int8_weight[affine=False] ") for k in kernels), eng.info.kernels
        shapes = {k.split()[1] for k in kernels}
        assert shapes == {"128x64", "64x64", "256x64", "64x128"}, shapes  # fused q/k/v and gate/up, o, down
        assert len(list((tmp_path / "kernel-plans").glob("*.json"))) == 1
        ref = eng.complete("The castle", greedy_exact(8, seed=0)).token_ids
    finally:
        eng.close()
    eng = Engine.from_path(str(art), EngineConfig(kernels="static", **cfg), tmp_path)
    try:
        assert eng.info.kernels == ()
        rule = eng.complete("The castle", greedy_exact(8, seed=0)).token_ids
        assert len(rule) == len(ref)
    finally:
        eng.close()
    # Measuring that fails (a GPU's capture that breaks, say) is a log line per computation and the built-in rule:
    # the engine starts and serves what the static engine serves.
    monkeypatch.setattr(KC, "time_paths_us", _failing_timer)
    with caplog.at_level(logging.WARNING, logger="quantserve.kernels"):
        eng = Engine.from_path(str(art), EngineConfig(kernels="measure", **cfg), tmp_path / "fresh")
    try:
        failed = [r.getMessage() for r in caplog.records if "not measured" in r.getMessage()]
        assert len(failed) == len(shapes) and all("RuntimeError: capture_begin failed" in m for m in failed), failed
        assert all("measuring failed (RuntimeError: capture_begin failed), the built-in rule" in k
                   for k in eng.info.kernels) and len(eng.info.kernels) == len(shapes)
        assert eng.complete("The castle", greedy_exact(8, seed=0)).token_ids == rule
    finally:
        eng.close()
    with pytest.raises(ValueError, match="--kernels must be one of measure, static, got 'fast'"):
        EngineConfig(kernels="fast").validate()


def _failing_timer(paths, x, *a, **k):
    raise RuntimeError("capture_begin failed\nsecond line of the trace")


@pytest.mark.unit
def test_measuring_that_fails_gives_the_rule_and_on_a_gpu_stops_measuring(monkeypatch, caplog):
    """A plan or a launch search whose timing raises gives None (the module's built-in rule), one warning naming
    the computation, and a line in the engine's table; on a GPU the chooser then measures nothing more, since a
    broken capture may leave the device's state in doubt. On a CPU the next computation is still measured."""
    monkeypatch.setattr(KC, "time_paths_us", _failing_timer)
    lin = _linear()
    paths = {"plain": lin, "again": lin}
    space = _space(((1, 2), (1,), (1,)), (1, 1, 1), lambda cfg: 1.0)
    cpu = KC.Chooser("measure")
    with caplog.at_level(logging.WARNING, logger="quantserve.kernels"):
        assert cpu.plan("a", paths, lin.in_features, torch.float32, "cpu") is None
        assert cpu.tune("b", space, 8, torch.float32, "cpu") is None
    assert caplog.messages == [
        "kernel plan for a not measured (RuntimeError: capture_begin failed): the built-in rule",
        "one-row launch for b not measured (RuntimeError: capture_begin failed): the built-in rule"]
    assert cpu.table() == ["a: measuring failed (RuntimeError: capture_begin failed), the built-in rule",
                           "b: measuring failed (RuntimeError: capture_begin failed), the built-in rule"]
    assert cpu.measures
    monkeypatch.setattr(KC, "device_key", lambda device, threads=None: "a GPU")
    monkeypatch.setattr(KC, "on_device", lambda device: contextlib.nullcontext())
    gpu = KC.Chooser("measure", device="cuda")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="quantserve.kernels"):
        assert gpu.tune("b", space, 8, torch.float32, "cuda") is None
    assert len(caplog.messages) == 1 and "nothing more is measured on this GPU" in caplog.messages[0]
    monkeypatch.setattr(KC, "time_paths_us", lambda *a, **k: pytest.fail("measured after a failed GPU timing"))
    assert gpu.plan("a", paths, lin.in_features, torch.float32, "cuda") is None
    # (on this CPU the search fails before the timer, making its CUDA generator: a failure all the same)
    assert len(gpu.table()) == 1 and gpu.table()[0].startswith("b: measuring failed (RuntimeError: ")


def _space(axes, start, cost, wrong=(), failing=(), resets=None):
    """A LaunchSpace over ``axes`` whose launch ``cfg`` computes x (x + 1 for a config in ``wrong``; raises for one
    in ``failing``, as a launch the compiler refuses) and costs ``cost(cfg)`` µs under the fake timer below."""
    def make(cfg):
        def fn(x):
            if cfg in failing:
                raise RuntimeError("out of resources: shared memory, Required: 300000, Hardware limit: 232448")
            return x + 1 if cfg in wrong else x.clone()

        fn.cfg = cfg
        return fn

    reset = None if resets is None else (lambda: resets.append(1))
    return KC.LaunchSpace(start, axes, ("A", "B", "C"), make, lambda x: x, reset)


def _fake_timer(cost):
    return lambda paths, x, *a, **k: {name: cost(fn.cfg) for name, fn in paths.items()}


@pytest.mark.unit
@pytest.mark.parametrize("seed", range(6))
def test_launch_search_finds_the_grid_best_on_separable_costs(seed, monkeypatch):
    """Costs with one minimum per axis (tile, split and warps act roughly so): the coordinate search reaches the
    best of the whole grid from any start, and measures far fewer configurations than the grid holds."""
    import itertools

    g = torch.Generator().manual_seed(seed)
    axes = ((16, 32, 64, 128), (1, 2, 4, 8, 16, 32), (2, 4, 8))
    centre = [float(torch.rand(1, generator=g)) * (len(a) - 1) for a in axes]
    weight = [float(torch.rand(1, generator=g)) + 0.1 for _ in axes]

    def cost(cfg):
        return 10 + sum(w * (a.index(v) - c) ** 2 for w, a, v, c in zip(weight, axes, cfg, centre))

    monkeypatch.setattr(KC, "time_paths_us", _fake_timer(cost))
    start = tuple(a[int(torch.randint(len(a), (1,), generator=g))] for a in axes)
    best, timed = KC.search(_space(axes, start, cost), 8, torch.float32)
    grid = list(itertools.product(*axes))
    assert best == min(grid, key=cost)
    assert timed[best] == cost(best) and start in timed
    assert len(timed) < len(grid) / 3


@pytest.mark.unit
def test_a_launch_that_disagrees_or_fails_is_never_chosen(monkeypatch, caplog):
    axes = ((1, 2, 3), (1, 2), (1,))
    cost = lambda cfg: float(sum(cfg))  # noqa: E731 - the smallest values are the fastest
    monkeypatch.setattr(KC, "time_paths_us", _fake_timer(cost))
    resets = []
    best, timed = KC.search(_space(axes, (3, 2, 1), cost, wrong={(1, 1, 1)}, failing={(1, 2, 1)}, resets=resets),
                            8, torch.float32)
    assert best == (2, 1, 1) and (1, 1, 1) not in timed and (1, 2, 1) not in timed
    assert "disagrees with the reference" in caplog.text and "failed: RuntimeError: out of resources" in caplog.text
    assert len(resets) == 2  # the kernel's state restored after each refused launch
    every = {(a, b, 1) for a in axes[0] for b in axes[1]}
    with pytest.raises(ValueError, match="no launch of the one-row kernel agrees with its reference"):
        KC.search(_space(axes, (3, 2, 1), cost, wrong=every), 8, torch.float32)


@pytest.mark.unit
def test_a_tuned_launch_is_kept_per_device_and_reported(tmp_path, monkeypatch):
    axes = ((1, 2, 3), (1, 2), (1,))
    cost = lambda cfg: float(abs(cfg[0] - 2) + cfg[1])  # noqa: E731
    monkeypatch.setattr(KC, "time_paths_us", _fake_timer(cost))
    space = _space(axes, (3, 2, 1), cost)
    c = KC.Chooser("measure", tmp_path)
    assert c.tune("k", space, 8, torch.float32, "cpu") == (2, 1, 1)
    assert c.table() == ["k: one row launched with A=2, B=1, C=1"]
    stored = json.loads(next((tmp_path / "kernel-plans").glob("*.json")).read_text())
    assert stored["plans"]["k one-row launch"]["config"] == [2, 1, 1]
    monkeypatch.setattr(KC, "search", lambda *a, **k: pytest.fail("searched although the launch was kept"))
    assert KC.Chooser("measure", tmp_path).tune("k", space, 8, torch.float32, "cpu") == (2, 1, 1)
    # A launch the space no longer holds is searched again; static mode and another device search nothing.
    narrower = _space(((1, 3), (1, 2), (1,)), (3, 2, 1), cost)
    with pytest.raises(pytest.fail.Exception, match="searched"):
        KC.Chooser("measure", tmp_path).tune("k", narrower, 8, torch.float32, "cpu")
    assert KC.Chooser("static", tmp_path).tune("k", space, 8, torch.float32, "cpu") is None
    assert KC.Chooser("measure", tmp_path).tune("k", space, 8, torch.float32, "meta") is None
