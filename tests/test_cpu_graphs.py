"""CPU step graphs (server/cpu_graphs.py): a recorded program replays what the eager ops compute, bit for bit; a
forward that is not a fixed program is refused and runs eagerly; the engine's decode steps replay them and serve
the same tokens and logprobs as without.

Every engine test of the suite decodes through replayed programs (they are on by default); these hold the
replay to the eager forward directly, on every family and on a quantized cache."""

from __future__ import annotations

import logging

import pytest
import torch
from archs import ARCHITECTURES
from helpers import greedy_exact

from server import fastops
from server.config import EngineConfig
from server.cpu_graphs import NotAProgram, agree, build, record
from server.engine import Engine
from server.sampling_params import SamplingParams
from server.speculate import DraftCosts

needs_ops = pytest.mark.skipif(not fastops.load(), reason="the C++ glue ops cannot be built here")


def prompt_ids(n: int, seed: int) -> list[int]:
    return torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _replay(fn, inputs, other_inputs):
    """fn's ops recorded on two sets of inputs, then replayed on a third: (eager result, replayed result)."""
    _, a = record(lambda: fn(*inputs), list(inputs))
    _, b = record(lambda: fn(*other_inputs), list(other_inputs))
    agree(a, b)
    prog, out = build(b, len(inputs))
    third = [t.clone() for t in other_inputs]
    return fn(*third), prog.run(third, [out])[0]


@needs_ops
@pytest.mark.unit
def test_replay_equals_eager_for_views_lists_numbers_and_promotion():
    w = torch.randn(8, 8)

    def fn(x, idx):
        h = torch.cat([x * 2.5, x.float() + 1], dim=-1)  # a number for a Tensor argument: promotes as a scalar
        a, b = h.split([8, 8], dim=-1)  # a list of outputs
        g = (a @ w)[idx]  # a list of optional tensors (index)
        return (g.sum(-1, keepdim=True) * b.to(torch.bfloat16)).float().softmax(-1)

    x0 = torch.arange(24, dtype=torch.float32).view(3, 8)
    inputs = [x0, torch.tensor([2, 0, 1])]
    other = [torch.randn(3, 8), torch.tensor([1, 1, 0])]
    want, got = _replay(fn, inputs, other)
    assert got.dtype == want.dtype and torch.equal(got, want)

    def ints(x):
        return x * 2.5  # an int tensor times a Python float: float32 (the default dtype), not float64

    want, got = _replay(ints, [torch.arange(4)], [torch.arange(4) + 3])
    assert got.dtype == torch.float32 and torch.equal(got, want)


@needs_ops
@pytest.mark.unit
def test_a_forward_that_is_not_a_fixed_program_is_refused():
    x, y = torch.randn(4), torch.randn(4)

    def fresh(t):
        return t + torch.tensor([1.0, 2.0, 3.0, 4.0])  # a tensor made afresh each step, not an input

    _, a = record(lambda: fresh(x), [x])
    _, b = record(lambda: fresh(y), [y])
    with pytest.raises(NotAProgram, match="made afresh"):
        agree(a, b)

    def reads(t):
        return t * float(t.sum())  # a value read into Python: the recording cannot hold it

    with pytest.raises(NotAProgram, match="reads in Python"):
        record(lambda: reads(x), [x])

    steps = iter([1, 2])

    def varies(t):
        return t.roll(next(steps))  # a Python value that changes between steps

    _, a = record(lambda: varies(x), [x])
    _, b = record(lambda: varies(y), [y])
    with pytest.raises(NotAProgram, match="changed"):
        agree(a, b)


@needs_ops
@pytest.mark.unit
def test_a_profiled_program_counts_and_times_each_op_and_computes_the_same():
    def fn(x, idx):
        a, b = (x * 2.0).split([4, 4], dim=-1)
        return (a[idx] + b[idx]).softmax(-1)

    inputs, other = [torch.randn(3, 8), torch.tensor([2, 0])], [torch.randn(3, 8), torch.tensor([1, 1])]
    _, a = record(lambda: fn(*inputs), list(inputs))
    _, b = record(lambda: fn(*other), list(other))
    agree(a, b)
    prog, out = build(b, 2)
    names = prog.op_names()
    assert len(names) == prog.size() and names[:2] == ["aten::mul.Tensor", "aten::split_with_sizes"]
    want = prog.run(other, [out])[0]
    prog.set_profile(True)
    for _ in range(3):
        assert torch.equal(prog.run(other, [out])[0], want)
    took = prog.take_profile()
    assert took.shape == (prog.size(), 2) and took[:, 0].tolist() == [3.0] * prog.size() and (took[:, 1] > 0).all()
    assert not prog.take_profile().any()  # taken: counted afresh
    prog.set_profile(False)
    prog.run(other, [out])
    assert not prog.take_profile().any()


@needs_ops
@pytest.mark.unit
def test_program_refuses_bad_arguments_with_one_line():
    prog = torch.classes.quantserve.StepProgram()
    prog.set_registers(1, 2)
    with pytest.raises(RuntimeError, match="arguments for a schema"):
        prog.add("aten::mul", "Tensor", [1], [0], [0], [], [], [1], [])
    with pytest.raises(RuntimeError, match="register out of range"):
        prog.add("aten::neg", "", [1], [5], [0], [], [], [1], [])
    prog.add("aten::neg", "", [1], [0], [0], [], [], [1], [])
    with pytest.raises(RuntimeError, match="takes 1 inputs"):
        prog.run([], [1])
    assert torch.equal(prog.run([torch.ones(2)], [1])[0], -torch.ones(2))


def _serve(path, cache_dir, graphs: bool, prompts, params, **cfg):
    eng = Engine.from_path(str(path), EngineConfig(memory_budget="8MiB", dtype=cfg.pop("dtype", "float32"),
                                                   cpu_graphs=graphs, **cfg), cache_dir)
    try:
        out = [eng.complete(p, params) for p in prompts]
        replays = eng.runner.cpu_graphs.replays if eng.runner.cpu_graphs is not None else 0
        return [(list(c.token_ids), [(t.logprob, t.top) for t in c.logprobs]) for c in out], replays
    finally:
        eng.close()


@needs_ops
@pytest.mark.reference
@pytest.mark.parametrize("arch", ["llama", "gemma2", "qwen3", "phi3-partial-window", "granite", "olmo2"])
def test_engine_replays_and_serves_what_the_eager_forward_serves(arch, arch_dirs, cache_dir):
    assert arch in ARCHITECTURES
    prompts = [prompt_ids(20, 4), prompt_ids(9, 5)]
    params = SamplingParams(max_new_tokens=24, min_tokens=24, temperature=0.8, seed=7, logprobs=2)
    eager, none = _serve(arch_dirs(arch), cache_dir, False, prompts, params, speculate="off")
    replayed, n = _serve(arch_dirs(arch), cache_dir, True, prompts, params, speculate="off")
    assert none == 0 and n >= 2 * 20  # all but each request's first two decode steps replayed
    assert replayed == eager  # the same tokens and logprobs, bit for bit


@needs_ops
@pytest.mark.reference
@pytest.mark.parametrize("arch", ["llama", "olmo2"])  # OLMo 2's norm epilogue returns the sum twice (no input norm)
def test_one_row_steps_through_the_rows_epilogues_replay_what_they_serve_eagerly(arch, arch_artifacts, cache_dir,
                                                                                 monkeypatch):
    """A w4a16 engine in bf16 whose one-row path is the int4 rows pass, so its decode steps run the model's one-row
    forward with the glue inside the projections' calls (quant.runtime.kernels.rows.Product): replayed, it serves the
    eager tokens and logprobs bit for bit."""
    from quant.runtime.int4 import GPTQLinear

    static = GPTQLinear.static_path
    monkeypatch.setattr(GPTQLinear, "static_path", lambda self, rows, dtype: "rows" if rows == 1 else
                        static(self, rows, dtype))
    prompts = [prompt_ids(20, 4), prompt_ids(9, 5)]
    params = SamplingParams(max_new_tokens=24, min_tokens=24, temperature=0.8, seed=7, logprobs=2)
    path = arch_artifacts(arch, "w4a16")
    eager, _ = _serve(path, cache_dir, False, prompts, params, speculate="off", dtype="bfloat16", kernels="static")
    eng = Engine.from_path(str(path), EngineConfig(memory_budget="8MiB", dtype="bfloat16", kernels="static"),
                           cache_dir)
    try:
        assert eng.runner.model._one_row  # the epilogues are what these steps run
    finally:
        eng.close()
    replayed, n = _serve(path, cache_dir, True, prompts, params, speculate="off", dtype="bfloat16", kernels="static")
    assert n >= 2 * 20 and replayed == eager


@needs_ops
@pytest.mark.reference
def test_profiled_replays_serve_the_same_and_say_where_the_step_went(tiny_model_dir, cache_dir):
    prompts = [prompt_ids(12, 6)] * 4
    params = SamplingParams(max_new_tokens=12, min_tokens=12, temperature=0.8, seed=3, logprobs=2)
    plain, _ = _serve(tiny_model_dir, cache_dir, True, prompts, params, speculate="off")
    eng = Engine.from_path(str(tiny_model_dir), EngineConfig(memory_budget="8MiB", dtype="float32",
                                                              speculate="off"), cache_dir)
    try:
        graphs, layers = eng.runner.cpu_graphs, len(eng.runner.model.layers)
        graphs.set_profile(True)  # before any program is built: each is built profiling
        got, took = [], []
        for p in prompts:
            before = graphs.replays
            c = eng.complete(p, params)
            got.append((list(c.token_ids), [(t.logprob, t.top) for t in c.logprobs]))
            took.append((graphs.replays - before, graphs.take_profile()))
    finally:
        eng.close()
    assert got == plain  # bit for bit
    replayed, prof = took[-1]
    assert replayed == 12 and all(n > 0 and sec > 0 for n, sec in prof.values())  # 11 decode steps and the prompt
    calls = {name: n for name, (n, _) in prof.items()}
    assert calls["aten::embedding"] == calls["quantserve::rms_norm"] == replayed  # once a step
    attention = calls["quantserve::rotary_decode_attention"] + calls["quantserve::prefill_attention_at"]
    assert attention == layers * replayed  # once a layer


@needs_ops
@pytest.mark.reference
@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_replay_over_a_quantized_cache_in_bf16(kv, tiny_model_dir, cache_dir):
    prompts = [prompt_ids(30, 9)]
    eager, _ = _serve(tiny_model_dir, cache_dir, False, prompts, greedy_exact(32), kv_dtype=kv, dtype="bfloat16",
                      speculate="off")
    replayed, n = _serve(tiny_model_dir, cache_dir, True, prompts, greedy_exact(32), kv_dtype=kv, dtype="bfloat16",
                         speculate="off")
    assert n > 0 and replayed == eager


@needs_ops
@pytest.mark.reference
def test_concurrent_steps_and_speculation_replay_by_row_count(tiny_model_dir, cache_dir, caplog):
    """Several requests at once (a program per decode row count) with n-gram speculation on, every draft verified
    (its verifications run eagerly, its plain steps replay): the same tokens as eager, no row count refused."""
    import threading

    prompts = [prompt_ids(12, s) * 3 for s in range(4)]  # repetitive: n-grams draft
    results: dict = {}
    for graphs in (False, True):
        eng = Engine.from_path(str(tiny_model_dir), EngineConfig(memory_budget="8MiB", dtype="float32",
                                                                 cpu_graphs=graphs, speculate="ngram"), cache_dir)
        try:
            assert eng.scheduler.draft_costs.decode is not None  # plain decode steps measured as they run
            eng.scheduler.speculate(DraftCosts(), eng.config.speculate_tokens)  # rows cost nothing: every draft
            out = [None] * len(prompts)

            def run(i):
                out[i] = list(eng.complete(prompts[i], greedy_exact(40)).token_ids)

            with caplog.at_level(logging.INFO, logger="quantserve.engine"):
                threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            results[graphs] = out
            if graphs:
                assert eng.runner.cpu_graphs.replays > 0 and None not in eng.runner.cpu_graphs.programs.values()
                assert eng.scheduler.speculated_tokens > 0
        finally:
            eng.close()
    assert results[True] == results[False]
    assert "run eagerly" not in caplog.text


@needs_ops
@pytest.mark.reference
def test_a_failure_of_the_replay_itself_turns_it_off_and_the_step_runs_eagerly(tiny_model_dir, cache_dir, caplog,
                                                                             monkeypatch):
    import server.cpu_graphs as cg

    prompts = [prompt_ids(16, 3)]
    want, _ = _serve(tiny_model_dir, cache_dir, False, prompts, greedy_exact(12), speculate="off")

    def broken(rec, n_inputs):
        raise RuntimeError("a program that cannot be built")

    monkeypatch.setattr(cg, "build", broken)
    with caplog.at_level(logging.WARNING, logger="quantserve.engine"):
        got, replays = _serve(tiny_model_dir, cache_dir, True, prompts, greedy_exact(12), speculate="off")
    assert got == want and replays == 0  # served, eagerly
    assert [r.message for r in caplog.records if "cpu graphs off" in r.message] == [
        "cpu graphs off (RuntimeError: a program that cannot be built); steps run eagerly"]
