"""Data of the lm-evaluation-harness tasks beside this file (qs_choice.yaml, qs_wikitext.yaml), from local files
only (no dataset download): lm-eval imports this module through the YAMLs' ``!function`` tags and passes the run's
``--metadata`` to the ``custom_dataset`` functions as keyword arguments."""

from __future__ import annotations

import json
import re
from pathlib import Path

import datasets
from lm_eval.tasks.wikitext.preprocess_wikitext import (  # noqa: F401 (the YAML's)
    process_results,
    wikitext_detokenizer,
)

HERE = Path(__file__).resolve().parent
SHARED = HERE.parents[2] / "shared" / "data" / "wikitext-2" / "test.txt"  # ../shared beside the checkout
SAMPLE = HERE / "wikitext_sample.txt"  # where the shared data is absent
_TITLE = re.compile(r"^ = [^=].* = $")  # a top-level heading (" = = Section = = " is a section)


def wikitext_documents(text: str) -> list[str]:
    """WikiText-2's raw text split into its articles (what EleutherAI/wikitext_document_level's pages are)."""
    pages: list[list[str]] = []
    for line in text.splitlines(keepends=True):
        if _TITLE.match(line.rstrip("\n")) or not pages:
            pages.append([])
        pages[-1].append(line)
    return ["".join(p).strip("\n") + "\n" for p in pages if "".join(p).strip()]


def wikitext(docs: int = 0, path: str = "", **_) -> datasets.DatasetDict:
    """The test split's articles (the first ``docs`` of them when given): ``path``, else the shared WikiText-2 test
    set, else the small sample beside this file."""
    src = Path(path) if path else SHARED if SHARED.is_file() else SAMPLE
    pages = wikitext_documents(src.read_text(encoding="utf-8"))
    if docs:
        pages = pages[:docs]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list([{"page": p} for p in pages])})


def choices(**_) -> datasets.DatasetDict:
    """Short factual questions with four continuations each (choice.jsonl)."""
    rows = [json.loads(line) for line in (HERE / "choice.jsonl").read_text(encoding="utf-8").splitlines() if line]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
