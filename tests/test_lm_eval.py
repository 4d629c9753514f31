"""lm-evaluation-harness end to end, offline: its evaluator, as its ``lm_eval`` command runs it, scores the tasks
beside this file (tests/lm_eval_tasks: a multiple-choice task on local text, and WikiText-2 test articles by rolling
loglikelihood) with the ``local-completions`` model against the real server of the default model on a loopback port,
and with its ``hf`` model on the same weights through transformers; the scores must agree (perplexity within 0.5%
relative, accuracy within 1 point). The full comparison (every article, the w4a16 artifact) is
bench/lm_eval_compare.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from live_server import start

from quant.format import sources as models

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
pytest.importorskip("lm_eval")

TASKS = Path(__file__).parent / "lm_eval_tasks"
DOCS = 1  # WikiText-2 test articles scored here (the first: 1,434 tokens, 3 windows; the bench scores all 62)
WINDOW = 512  # tokens per rolling window, the same for both models


def lm_eval(model: str, model_args: str, **kwargs) -> dict:
    """lm-evaluation-harness in a process of its own, as its ``lm_eval`` command runs it (``simple_evaluate`` with
    the command's seeds, ``--seed 0``) over the tasks beside this file alone: its TaskManager without the ~14,000
    built-in tasks, whose indexing costs the command ~9 s a run; the results' "results"."""
    code = (
        "import json, sys\n"
        "from lm_eval import simple_evaluate\n"
        "from lm_eval.tasks import TaskManager\n"
        "from lm_eval.utils import handle_non_serializable\n"
        "a = json.loads(sys.argv[1])\n"
        "tm = TaskManager(include_path=a.pop('include_path'), include_defaults=False, metadata=a['metadata'])\n"
        "r = simple_evaluate(task_manager=tm, **a)\n"
        "print(json.dumps(r['results'], default=handle_non_serializable))\n")
    args = {"model": model, "model_args": model_args, "tasks": ["qs_choice", "qs_wikitext"],
            "include_path": str(TASKS), "metadata": {"docs": DOCS}, "random_seed": 0, "numpy_random_seed": 0,
            "torch_random_seed": 0, "fewshot_random_seed": 0, **kwargs}
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    p = subprocess.run([sys.executable, "-c", code, json.dumps(args)], capture_output=True, text=True, timeout=600,
                       env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_lm_eval_scores_the_served_model_as_it_scores_the_model_in_transformers(cache_dir):
    model_dir = str(models.resolve(None, cache_dir).path)
    server = start(model_dir, cache_dir, memory_budget="256MiB", max_prefill_tokens=256)
    try:
        # batch_size 4: each HTTP request carries 4 prompts (OpenAI's batch of token-id prompts), each scored with
        # echo, logprobs 1 and max_tokens 1. max_length is the window + 2: lm-eval's API models keep one token back
        # for generation and cut their rolling windows one shorter than their max_length again, where its hf model
        # cuts them at max_length (lm_eval/models/api_models.py and huggingface.py, loglikelihood_rolling)
        served = lm_eval("local-completions",
                         f"base_url={server.http}/v1/completions,model=default,tokenizer_backend=huggingface,"
                         f"tokenizer={model_dir},max_length={WINDOW + 2},max_retries=1", batch_size=4)
    finally:
        server.shutdown()
    assert server.rc == 0
    local = lm_eval("hf", f"pretrained={model_dir},dtype=float32,max_length={WINDOW}", device="cpu", batch_size=4)
    for metric in ("word_perplexity,none", "byte_perplexity,none"):
        s, h = served["qs_wikitext"][metric], local["qs_wikitext"][metric]
        assert abs(s / h - 1) < 0.005, (metric, s, h)
    assert abs(served["qs_choice"]["acc,none"] - local["qs_choice"]["acc,none"]) <= 0.01, (served, local)
    assert served["qs_choice"]["acc,none"] > 0.5  # the real model, not noise: most of the 24 facts right
