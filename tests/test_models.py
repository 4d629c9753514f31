"""The engine's model definitions against transformers, per architecture (tests/archs.py): logits at every
position of a 100-token prompt, greedy generation past the sliding window alone and batched, mixed steps of
prefill chunks and decode rows across a window boundary, and each scheme's artifact against quant.load."""

from __future__ import annotations

import threading

import pytest
import torch
from archs import ARCHITECTURES, WINDOW
from helpers import greedy_exact, hf_causal_lm, hf_logits
from transformers import AutoModelForCausalLM

from server.config import EngineConfig
from server.engine import Engine
from server.kv_pool import BlockPool, KVLayout
from server.runner import ModelRunner, build_step

pytestmark = pytest.mark.reference

CPU = torch.device("cpu")
ARCHS = list(ARCHITECTURES)


def prompt_ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (n,), generator=g).tolist()


def runner_for(model, blocks: int = 64, block_size: int = 16, fused_ops: bool = True, backend: str = "sdpa",
               glue: str | None = None):
    lay = KVLayout.from_config(model.config, torch.float32, block_size=block_size)
    pool = BlockPool(lay, lay.bytes_per_block * blocks)
    return ModelRunner(model, pool.storage, block_size, backend, fused_ops=fused_ops, glue=glue), pool


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_at_every_position_match_transformers(arch, arch_dirs):
    model = hf_causal_lm(arch_dirs(arch))
    ids = prompt_ids(100, 0)
    ref = hf_logits(model, ids)  # (100, V)
    runner, pool = runner_for(model)
    step = build_step([], [(ids, 0, pool.try_reserve("a", 100), True)], 16, CPU)
    step.sample_index = torch.arange(100)  # every position's logits, not only the last
    got = runner.forward(step)
    assert (got - ref).abs().max().item() <= 1e-4
    assert ref[-1].abs().max() > 1.0  # the check is not vacuous: the logits are not all near zero


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fused_ops", [True, False])
def test_mixed_steps_with_chunks_across_the_window_and_fragmented_blocks(arch, arch_dirs, fused_ops):
    """Prefill chunks that cross the sliding window's edge, decode rows beside them, non-contiguous blocks."""
    model = hf_causal_lm(arch_dirs(arch))
    runner, pool = runner_for(model, blocks=72, block_size=4, fused_ops=fused_ops)
    pool.try_reserve("x", 12)
    pool.try_reserve("y", 12)
    pool.release("x")  # fragment the pool so block tables are not contiguous
    a, b, c = prompt_ids(70, 1), prompt_ids(9, 2), prompt_ids(45, 3)
    ta, tb, tc = (pool.try_reserve(n, 80) for n in "abc")
    tol = dict(atol=1e-4, rtol=1e-4)
    # step 1: a's first 30 (inside the window), b whole; step 2: a's next 25 (crossing it) + b decoding
    l1 = runner.forward(build_step([], [(a[:30], 0, ta, False), (b, 0, tb, True)], 4, CPU))
    torch.testing.assert_close(l1[0], hf_logits(model, b)[-1], **tol)
    l2 = runner.forward(build_step([(11, 9, tb)], [(a[30:55], 30, ta, True)], 4, CPU))
    torch.testing.assert_close(l2[0], hf_logits(model, b + [11])[-1], **tol)
    torch.testing.assert_close(l2[1], hf_logits(model, a[:55])[-1], **tol)
    # step 3: a's last chunk, b decoding, c whole (longer than the window in one chunk)
    l3 = runner.forward(build_step([(7, 10, tb)], [(a[55:], 55, ta, True), (c, 0, tc, True)], 4, CPU))
    torch.testing.assert_close(l3[0], hf_logits(model, b + [11, 7])[-1], **tol)
    torch.testing.assert_close(l3[1], hf_logits(model, a)[-1], **tol)
    torch.testing.assert_close(l3[2], hf_logits(model, c)[-1], **tol)
    # step 4: a and c decoding past the window, batched (gathered, per-window masks)
    l4 = runner.forward(build_step([(5, 70, ta), (6, 45, tc)], [], 4, CPU))
    torch.testing.assert_close(l4[0], hf_logits(model, a + [5])[-1], **tol)
    torch.testing.assert_close(l4[1], hf_logits(model, c + [6])[-1], **tol)


@pytest.mark.parametrize("arch", ["llama", "gemma2", "qwen3", "phi3-partial-window", "olmo2"])
def test_the_cuda_path_on_cpu_matches_transformers(arch, arch_dirs):
    """What CUDA runs, the triton attention backend and the Triton glue kernels, here under Triton's interpreter:
    a prefill chunk, a second chunk after it and a decode row, against transformers' logits. The architectures
    cover GELU (Gemma 2) and SiLU, head and projection q/k norms (Qwen3, OLMo 2), partial rotary and windows."""
    from server.attention.triton_paged import available

    if available() is not None:
        pytest.skip(available())
    model = hf_causal_lm(arch_dirs(arch))
    runner, pool = runner_for(model, backend="triton", glue="triton")
    assert runner.ops.kind == "triton" and runner.attention == "triton"
    a = prompt_ids(40, 4)
    ta = pool.try_reserve("a", 48)
    tol = dict(atol=1e-4, rtol=1e-4)
    l1 = runner.forward(build_step([], [(a[:24], 0, ta, True)], 16, CPU))
    torch.testing.assert_close(l1[0], hf_logits(model, a[:24])[-1], **tol)
    l2 = runner.forward(build_step([], [(a[24:], 24, ta, True)], 16, CPU))
    torch.testing.assert_close(l2[0], hf_logits(model, a)[-1], **tol)
    l3 = runner.forward(build_step([(9, 40, ta)], [], 16, CPU))
    torch.testing.assert_close(l3[0], hf_logits(model, a + [9])[-1], **tol)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_cuda_decode_layer_launches_its_attention_once(arch, arch_dirs, monkeypatch):
    """A decode step on the CUDA path launches, per layer, two norms, the attention (with Qwen3's q/k head norms,
    the rotary, the cache write and the split keys' merge inside it) and the activation, besides the projections
    (here dense: cuBLAS); a prefill chunk launches the rotary with the cache write before its attention. Counted
    under Triton's interpreter."""
    from collections import Counter

    from triton.runtime.interpreter import InterpretedFunction

    from server.attention.triton_paged import TritonBackend

    model = hf_causal_lm(arch_dirs(arch))
    runner, pool = runner_for(model, backend="triton", glue="triton")
    launched: Counter = Counter()
    run = InterpretedFunction.run

    def counting(self, *args, **kwargs):
        launched[self.fn.__name__] += 1
        return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", counting)
    monkeypatch.setattr(TritonBackend, "MIN_SPLIT_KEYS", 16)  # the decode row's 41 keys in split parts
    a = prompt_ids(40, 5)
    ta = pool.try_reserve("a", 48)
    runner.forward(build_step([], [(a, 0, ta, True)], 16, CPU))
    layers = model.config.num_hidden_layers
    assert launched["_rope_kernel"] == layers and launched["paged_attention"] == layers
    assert launched["_norm_kernel"] == 2 * layers + 1 + (2 * layers if arch == "qwen3" else 0)  # Qwen3: q's, k's
    launched.clear()
    logits = runner.forward(build_step([(7, 40, ta)], [], 16, CPU))
    assert dict(launched) == {"_norm_kernel": 2 * layers + 1, "paged_attention": layers, "_act_mul_kernel": layers}
    torch.testing.assert_close(logits[0], hf_logits(model, a + [7])[-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gemma2", "olmo2", "granite"])
def test_a_w4a16_artifact_in_the_cuda_layout_decodes_with_gated_gemvs(arch, arch_artifacts, cache_dir, monkeypatch):
    """A w4a16 artifact held in the layout CUDA takes (the Triton GEMVs; on this CPU through Triton's interpreter,
    fp16), the triton attention backend and glue: a decode step launches four one-row products per layer, no
    activation kernel (the gate_up launch ends in it) and at most one norm in all (o and down end in the norms and
    residual add around them: Llama's input norms, Gemma 2's output norms besides, OLMo 2's output norms alone,
    Granite's residual multiplier), and its logits are bit for bit those of the same model with those launched
    apart, and near the artifact's own through transformers in fp32."""
    from collections import Counter

    from triton.runtime.interpreter import InterpretedFunction

    from quant.runtime.int4 import GPTQLinear
    from quant.runtime.loader import load_for_engine

    out = arch_artifacts(arch, "w4a16")
    monkeypatch.setattr(GPTQLinear, "runtime_layout",
                        lambda self, dtype: "w4triton" if dtype in (torch.float16, torch.bfloat16) else "gptq")
    model = load_for_engine(out, dtype=torch.float16, cache_dir=cache_dir).model
    lay = KVLayout.from_config(model.config, torch.float16, block_size=16)
    pool = BlockPool(lay, lay.bytes_per_block * 16)
    runner = ModelRunner(model, pool.storage, 16, "triton", glue="triton")
    mlps = [layer.mlp for layer in runner.model.layers]
    assert all(m.gated is not None for m in mlps)
    launched: Counter = Counter()
    run = InterpretedFunction.run
    monkeypatch.setattr(InterpretedFunction, "run",
                        lambda self, *a, **kw: launched.update([self.fn.__name__]) or run(self, *a, **kw))
    a = prompt_ids(20, 6)
    ta = pool.try_reserve("a", 32)
    runner.forward(build_step([], [(a, 0, ta, True)], 16, CPU))
    assert runner.model._one_row  # every o and down ends in the residual add and the next norm at one row
    act = "gelu_tanh_mul" if arch == "gemma2" else "silu_mul"
    assert runner.kernel_notes() == [
        f"gate_up of 2 layer(s): one-row launches end in {act}, no activation kernel at batch 1",
        "o and down: 4 one-row launches end in the residual add and the norms around it, no norm kernel between the "
        "layers at batch 1"]
    first = runner.model.layers[0].attn_in is not None  # the first layer's input norm: the step's one norm launch
    logits, gated = {}, [m.gated for m in mlps]
    for fused in (True, False):  # the same decode step twice: its K/V write is the same both times
        for m, g in zip(mlps, gated):
            m.gated = g if fused else None
        runner.model._one_row = fused
        launched.clear()
        logits[fused] = runner.forward(build_step([(7, 20, ta)], [], 16, CPU))
        layers = len(mlps)
        assert launched["w4_gemv_kernel"] == 4 * layers
        assert launched["_act_mul_kernel"] == (0 if fused else layers)
        qk = 2 * layers if runner.model.qk_norm == "proj" else 0  # OLMo 2's q and k norms over all heads
        if fused:
            assert launched["_norm_kernel"] == first + qk
        else:  # each norm the family's layers have, and the final one
            norms = sum(getattr(m, n) is not None for m in runner.model.layers
                        for n in ("attn_out", "mlp_in", "mlp_out", "attn_in"))
            assert launched["_norm_kernel"] == norms + 1 + qk and norms >= 2 * layers
    assert torch.equal(logits[True], logits[False])
    from quant.runtime.loader import load

    want = hf_logits(load(out, dtype=torch.float32).model, a + [7])[-1]  # the artifact through transformers, fp32
    err = (logits[True][0] - want).abs().max() / want.abs().max()
    assert err < 2e-2, err


@pytest.mark.parametrize("arch,scheme,path", [("llama", "w4a16", "rows16"), ("gemma2", "w4a16", "rows"),
                                              ("olmo2", "w4a16", "rows16"), ("granite", "w4a16", "rows"),
                                              ("llama", "int8-sym", "rows16"), ("gemma2", "int8-affine", "rows")])
def test_an_artifact_decodes_one_row_steps_through_the_rows_epilogues(arch, scheme, path, arch_artifacts, cache_dir,
                                                                      monkeypatch):
    """On a CPU whose one-row path is a C++ rows pass (int4 or int8 weights; ``rows``, or ``rows16`` where the CPU
    has it), gate_up ends in the activation and o and down in the norms and residual add around them inside that
    pass's own call (quant.runtime.kernels.rows.Product; Llama's input norms, Gemma 2's output norms besides, OLMo
    2's output norms alone, Granite's residual multiplier): a decode step calls no glue op but the first input norm,
    and its logits are bit for bit those of the same model with the glue ops called apart."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    from quant.runtime.int4 import GPTQLinear
    from quant.runtime.int8 import Int8WeightLinear
    from quant.runtime.kernels import rows
    from quant.runtime.loader import load_for_engine

    if path == "rows16" and not rows.rows16_built():
        pytest.skip("this CPU has no rows16 pass (AVX2 builds only)")
    out = arch_artifacts(arch, scheme)
    module = GPTQLinear if scheme == "w4a16" else Int8WeightLinear
    static = module.static_path
    monkeypatch.setattr(module, "static_path", lambda self, rows, dtype: path if rows == 1 else
                        static(self, rows, dtype))
    model = load_for_engine(out, dtype=torch.bfloat16, cache_dir=cache_dir).model
    lay = KVLayout.from_config(model.config, torch.bfloat16, block_size=16)
    pool = BlockPool(lay, lay.bytes_per_block * 16)
    runner = ModelRunner(model, pool.storage, 16, "sdpa", cpu_graphs=False)
    mlps = [layer.mlp for layer in runner.model.layers]
    assert runner.model._one_row and all(m.gated is not None for m in mlps)
    act = "gelu_tanh_mul" if arch == "gemma2" else "silu_mul"
    assert runner.kernel_notes()[-2:] == [
        f"gate_up of 2 layer(s): one-row launches end in {act}, no activation kernel at batch 1",
        "o and down: 4 one-row launches end in the residual add and the norms around it, no norm kernel between the "
        "layers at batch 1"]

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.called: Counter = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.called[func.name()] += 1
            return func(*args, **(kwargs or {}))

    a = prompt_ids(20, 6)
    ta = pool.try_reserve("a", 32)
    runner.forward(build_step([], [(a, 0, ta, True)], 16, CPU))
    logits, gated, layers = {}, [m.gated for m in mlps], len(mlps)
    for fused in (True, False):  # the same decode step twice: its K/V write is the same both times
        for m, g in zip(mlps, gated):
            m.gated = g if fused else None
        runner.model._one_row = fused
        with Ops() as ops:
            logits[fused] = runner.forward(build_step([(7, 20, ta)], [], 16, CPU))
        called = {k.split("::")[1]: n for k, n in ops.called.items() if k.startswith("quantserve")}
        product = {("w4a16", "rows"): "int4_rows", ("w4a16", "rows16"): "int4_rows_a16"}.get(
            (scheme, path), "int8_weight_" + path)
        if fused:
            first = runner.model.layers[0].attn_in is not None  # the first layer's input norm
            qk = 2 * layers if runner.model.qk_norm == "proj" else 0  # OLMo 2's q and k norms over all heads
            assert {k: called.get(k, 0) for k in (product, f"{product}_gated", f"{product}_normed", "rms_norm")} == {
                product: layers, f"{product}_gated": layers, f"{product}_normed": 2 * layers, "rms_norm": first + qk}
            assert "add_rms_norm" not in called and act not in called
        else:
            assert called[product] == 4 * layers and called[act] == layers
    assert torch.equal(logits[True], logits[False])
    assert logits[True].abs().max() > 1.0  # not vacuous


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()


def run_batched(engine: Engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    results: list = [None] * len(prompts)

    def run(i):
        results[i] = list(engine.complete(prompts[i], greedy_exact(n)).token_ids)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_48_past_the_window_equals_generate_alone_and_batched(arch, arch_dirs, cache_dir):
    path = arch_dirs(arch)
    model = hf_causal_lm(path)
    main, others = prompt_ids(20, 4), [prompt_ids(13, 5), prompt_ids(37, 6)]
    want = hf_greedy(model, main, 48)
    assert 20 + 48 > 2 * WINDOW and len(set(want)) >= 4  # past the window, and not one repeated token
    engine = Engine.from_path(str(path), EngineConfig(memory_budget="8MiB", dtype="float32",
                                                      max_prefill_tokens=16), cache_dir)
    try:
        assert list(engine.complete(main, greedy_exact(48)).token_ids) == want
        batched = run_batched(engine, [others[0], main, others[1]], 48)
        assert batched[1] == want
        assert batched[2] == hf_greedy(model, others[1], 48)
    finally:
        engine.close()


def test_cancellation_mid_window_frees_blocks_and_others_continue(arch_dirs, cache_dir):
    path = arch_dirs("gemma2")
    model = hf_causal_lm(path)
    engine = Engine.from_path(str(path), EngineConfig(memory_budget="8MiB", dtype="float32",
                                                      max_prefill_tokens=16), cache_dir)
    try:
        keep, drop = prompt_ids(30, 7), prompt_ids(30, 8)
        events = []
        handle = engine.submit(drop, greedy_exact(200), events.append)
        result = engine.complete(keep, greedy_exact(40))
        handle.cancel()
        for _ in range(2000):
            if events and events[-1].finished:
                break
            threading.Event().wait(0.005)
        assert events[-1].finished and events[-1].finish_reason == "cancelled"
        assert list(result.token_ids) == hf_greedy(model, keep, 40)
        for _ in range(2000):
            if engine.pool.used_blocks == 0:
                break
            threading.Event().wait(0.005)
        assert engine.pool.used_blocks == 0
    finally:
        engine.close()


# ------------------------------------------------------------------------------------------------ artifacts

# CI serves eight (architecture, scheme) pairs, each scheme on two or three families (llama's artifacts are
# also served in tests/test_engine.py; granite's w4a16 calibrates in stages with its residual multiplier, OLMo 2's
# post-norm layers through the exact forward); QUANTSERVE_ALL_SCHEMES=1 runs the whole matrix (a build of a tiny
# model takes 10-60 s on 2 cores).
CI_CASES = [("mistral-window", "int8-sym"), ("gemma3", "int8-sym"), ("qwen3", "w4a16"), ("phi3", "w4a16"),
            ("granite", "w4a16"), ("qwen2-window", "w8a8"), ("gemma2", "w8a8"), ("olmo2", "w8a8")]
FAMILIES = ["llama", "mistral-window", "qwen2-window", "qwen3", "gemma", "gemma2", "gemma3", "phi3", "granite",
            "olmo2"]
ALL = [(a, s) for a in FAMILIES for s in ("int8-sym", "w4a16", "w8a8")]


def artifact_cases():
    import os

    if os.environ.get("QUANTSERVE_ALL_SCHEMES") == "1":
        return ALL
    return CI_CASES


@pytest.mark.parametrize("arch,scheme", artifact_cases())
def test_quantized_artifact_is_served_equal_to_quant_load_generate(arch, scheme, arch_artifacts, cache_dir):
    from quant.runtime.loader import load

    out = arch_artifacts(arch, scheme)
    ref_model = load(out, dtype=torch.float32).model
    main, other = prompt_ids(20, 9), prompt_ids(31, 10)
    want = hf_greedy(ref_model, main, 40)
    engine = Engine.from_path(str(out), EngineConfig(memory_budget="8MiB", dtype="float32", max_prefill_tokens=16),
                              cache_dir)
    try:
        assert engine.info.scheme == scheme
        alone = list(engine.complete(main, greedy_exact(40)).token_ids)
        batched = run_batched(engine, [other, main], 40)
    finally:
        engine.close()
    if scheme != "w8a8":
        assert alone == want
        assert batched[1] == want
        assert batched[0] == hf_greedy(ref_model, other, 40)
    else:
        # W8A8 rounds activations to int8 with a static scale, a step function: the engine's fp32 sums run in
        # another order than transformers' (its own attention and norms; in a batch, other rows beside), so now
        # and then a code moves by one step, and through the keys and values of that position every later
        # position's logits move too (measured: from 1e-6 before the flip to 0.2 on top logits of 5.5 after it,
        # phi3) and near-ties flip (gemma3 and phi3 alone, gemma2 batched; qwen2-window's first token, whose top
        # two logits lie 0.006 apart, after one layer-1 input code flipped). So: over each whole sequence,
        # teacher-forced, the engine's logits stay within 5% of the top logit's scale of the reference's; every
        # token it chose is the reference's argmax up to twice the largest deviation measured on that sequence;
        # and alone it chose the reference's greedy tokens exactly up to the first such near-tie (all 40 where no
        # code flipped: the deviation is then ~1e-6).
        runner, pool = runner_for(ref_model)
        for prompt, got in ((main, alone), (main, batched[1]), (other, batched[0])):
            seq = prompt + got
            step = build_step([], [(seq, 0, pool.try_reserve("tf", len(seq)), True)], 16, CPU)
            step.sample_index = torch.arange(len(prompt) - 1, len(seq) - 1)
            eng = runner.forward(step)  # (40, V)
            pool.release("tf")
            ref = hf_logits(ref_model, seq)[len(prompt) - 1 : -1]  # (40, V)
            delta = (eng - ref).abs().max(-1).values  # (40,)
            top = ref.max(-1).values  # (40,)
            assert delta.max() <= 0.05 * top.abs().mean(), (delta, top.abs().mean())
            gap = top - ref.gather(1, torch.tensor(got)[:, None])[:, 0]
            assert (gap <= 2 * delta.max() + 1e-6).all(), (gap.max(), delta.max())
            if got is alone:
                top2 = ref.topk(2, dim=-1).values  # (40, 2)
                tie = (top2[:, 0] - top2[:, 1] <= 2 * delta.max() + 1e-6).tolist() + [True]
                clear = tie.index(True)  # positions before the reference's first near-tie
                assert alone[:clear] == want[:clear], (clear, delta.max())


# ------------------------------------------------------------------------------------------------ refusals


def test_an_unregistered_architecture_is_refused_in_one_line_naming_it(tmp_path, tokenizer, cache_dir):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from quant.errors import QuantError, UnsupportedModelError
    from server import models

    path = tmp_path / "neox"
    GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, intermediate_size=128)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    with pytest.raises(UnsupportedModelError) as e:
        Engine.from_path(str(path), EngineConfig(memory_budget="1MiB", dtype="float32"), cache_dir)
    msg = str(e.value)
    assert isinstance(e.value, QuantError) and "\n" not in msg
    assert "'gpt_neox'" in msg and all(t in msg for t in models.supported())


def test_quant_serve_refuses_an_unregistered_architecture_in_one_line(tmp_path, tokenizer):
    import subprocess
    import sys

    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    path = tmp_path / "neox"
    GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, intermediate_size=128)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    p = subprocess.run([sys.executable, "-m", "quant.cli", "serve", str(path), "--grpc-port", "0", "--http-port", "0",
                        "--memory-budget", "1MiB", "--dtype", "float32"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 1
    lines = [ln for ln in p.stderr.splitlines() if ln.strip() and "Loading weights" not in ln]
    assert "Traceback" not in p.stderr
    assert any("'gpt_neox'" in ln and "qwen3" in ln for ln in lines), p.stderr[-2000:]


def test_a_rope_type_the_engine_does_not_implement_is_refused(arch_dirs):
    from quant.errors import UnsupportedModelError

    model = AutoModelForCausalLM.from_pretrained(arch_dirs("llama"), dtype=torch.float32)
    model.config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(UnsupportedModelError, match="rope type 'dynamic' is not served"):
        runner_for(model)
