"""A served model's tokenizer, shared by the transports' threads and the engine thread: a fast tokenizer must not
be used from two threads at once, so every use goes through one lock (``TextCodec.lock``: the engine holds it
while it detokenizes a step's tokens)."""

from __future__ import annotations

import threading

from server.outputs import RequestError


class TextCodec:
    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.lock = threading.Lock()

    def tokenize(self, text: str) -> list[int]:
        with self.lock:
            return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation through the tokenizer's chat template, ready for the assistant's turn."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError("messages", "this model's tokenizer has no chat template; use /v1/completions")
        with self.lock:
            ids = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # newer transformers return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def token_text(self, token_id: int) -> str:
        """One token's text on its own (for logprobs and traces shown to people)."""
        with self.lock:
            return self.tokenizer.decode([token_id])

    def decode(self, ids: list[int]) -> str:
        """The text of token ids, special tokens included (an echoed prompt)."""
        with self.lock:
            return self.tokenizer.decode(ids)

    def prompt_ids(self, prompt) -> list[int]:
        """A prompt's token ids: a text tokenized, or ids checked (integers in the vocabulary); RequestError naming
        ``prompt`` otherwise."""
        if isinstance(prompt, str):
            return self.tokenize(prompt) if prompt else []
        if not isinstance(prompt, (list, tuple)):
            raise RequestError("prompt", f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        for t in prompt:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise RequestError("prompt", f"prompt token ids must be integers in [0, {self.vocab_size}), got {t!r}")
        return list(prompt)


def eos_ids(model, tokenizer) -> frozenset[int]:
    """Every token id that ends generation: the generation config's, the checkpoint's, the model config's and the
    tokenizer's."""
    ids = set()
    gen = getattr(model, "generation_config", None)  # a transformers model's; a module tree carries the ids
    for src in (getattr(gen, "eos_token_id", None), getattr(model, "generation_eos", None),
                model.config.eos_token_id, tokenizer.eos_token_id):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(i) for i in src)
    return frozenset(ids)
