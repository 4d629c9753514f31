"""Helpers several test modules share (the live server and its fixture are tests/live_server.py's; the load, fuzz
and drain drivers server/loadgen's). Each imports what it needs when called, so importing this module costs
nothing."""

from __future__ import annotations


def greedy(n: int, **kw):
    """Greedy decoding of at most ``n`` new tokens (a stop or EOS may end it sooner)."""
    from server.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_new_tokens=n, **kw)


def greedy_exact(n: int, **kw):
    """Greedy decoding of exactly ``n`` new tokens (``min_tokens=n``: an EOS cannot end it sooner)."""
    return greedy(n, min_tokens=n, **kw)


def assert_same_completion(got, want) -> None:
    """The same tokens, text and finish; logprobs within 1e-4 and the same top ids (speculation's tests, float32: a
    verification's rows may take another of the kernel plan's paths than one row does, which sums in another
    order)."""
    assert got.token_ids == want.token_ids and got.text == want.text
    assert got.finish_reason == want.finish_reason
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        assert abs(a.logprob - b.logprob) <= 1e-4
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def hf_logits(model, ids: list[int]):
    """A transformers model's float logits at every position of ``ids``: (T, V)."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()  # (T, V)


def hf_causal_lm(model_dir, dtype=None):
    """transformers' model of ``model_dir`` (float32 unless ``dtype``), in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype or torch.float32).eval()


def peft_merged(model_dir, adapter_dir, dtype=None) -> dict:
    """The state dict PEFT's own ``merge_and_unload()`` gives for the adapter at ``adapter_dir`` on ``model_dir``."""
    import warnings

    from peft import PeftModel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        merged = PeftModel.from_pretrained(hf_causal_lm(model_dir, dtype), adapter_dir).merge_and_unload()
    return merged.state_dict()


def file_mappings(path) -> list[tuple[int, int, int]]:
    """(start, end, resident bytes) of each of this process's mappings of the file ``path`` (/proc/self/smaps)."""
    import re
    from pathlib import Path

    out, current = [], None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            fields = line.split()
            current = None
            if len(fields) > 5 and fields[5] == str(Path(path).resolve()):
                current = [int(x, 16) for x in fields[0].split("-")]
        elif line.startswith("Rss:") and current is not None:
            out.append((*current, int(line.split()[1]) * 1024))
    return out


def gptq_linear(n: int, k: int, bias: bool, act_order: bool, seed: int = 0, group: int = 64, sym: bool = True):
    """A GPTQLinear (v1, groups of ``group``) of a seeded random weight rounded to its grid (symmetric, or with a zero
    point per group), prepared for bf16."""
    import torch

    from quant.build import gptq as G
    from quant.runtime import int4

    g = torch.Generator().manual_seed(seed)
    q = G.rtn(torch.randn(n, k, generator=g), 4, group, sym=sym)
    m = int4.GPTQLinear.from_quantized(q, torch.randn(n, generator=g) if bias else None, v2=False)
    if act_order:  # a checkpoint written with desc_act: groups over a shuffled column order (prepare permutes)
        m.g_idx = (torch.randperm(k, generator=g) // group).to(torch.int32)
    m.prepare(torch.bfloat16)
    return m


def word_tokenizer(vocab: int):
    """A tokenizer over ids alone (random-weight models have no text): token i is the word 't<i>'."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="t2", eos_token="t1", unk_token="t0")
