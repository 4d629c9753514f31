"""Structured output: ``response_format`` JSON mode (``{"type": "json_object"}``) and JSON-schema mode
(``{"type": "json_schema", "json_schema": {"schema": ...}}``), enforced token by token with xgrammar.

Why xgrammar (a comparison on an AMD EPYC with the default model's 49152-token vocabulary, noted in
bench/RESULTS.md#json-modes-cost-per-decode-step-benchjson_modepy): of the
three well-kept libraries compared, xgrammar (Apache-2.0) filled a step's mask fastest (2 us median for a nested
schema, 8 us for any JSON object; llguidance, MIT: 16 and 9 us; outlines-core: 2 and 59 us but 7.3 s to compile
``{"type": "object"}``), accepted the most valid documents (outlines-core rejects pretty-printed JSON and \\u
escapes; llguidance rejects \\u escapes by default), and caches compiled schemas itself. All three reject keys in
an order other than the schema's.

How it runs: a request's grammar is compiled when it is submitted (an invalid schema is refused there, naming
``response_format``); each of its samples gets a matcher. Before a step samples, the engine fills one bitmask row
per constrained row (a 32-bit word per 32 tokens, xgrammar's layout; unconstrained rows all ones), which the sampler
unpacks and applies after the logit bias and penalties (server/sampling.py, step 3's end). After a step's tokens are
read back each matcher accepts its token; a matcher that has terminated (it accepted EOS) ends its request. The
mask for a token needs the token before it, so a constrained request is never decoded from a sample still on the
device (the scheduler waits for the read-back: such a request runs every other step when steps overlap).

xgrammar is imported when the first request asks for a response format, so a server that never sees one never
loads it; without it installed, such a request is refused in one line.
"""

from __future__ import annotations

import json
import threading

from torch import Tensor

from server.sampling_params import SamplingParamsError


class Grammars:
    """The engine's grammar compiler over its tokenizer (built on first use; compiled schemas cached by xgrammar)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int], tokenizer_lock: threading.Lock):
        """``tokenizer_lock``: the engine's, held while xgrammar reads the tokenizer (a fast tokenizer must not be
        used from two threads at once)."""
        self._tokenizer, self.vocab_size, self._stop_ids = tokenizer, vocab_size, list(stop_ids)
        self._tokenizer_lock = tokenizer_lock
        self._compiler = None
        self._lock = threading.Lock()  # submissions come from several threads

    def _xgr(self):
        try:
            import xgrammar
        except ImportError:
            raise SamplingParamsError("response_format", "response_format needs the xgrammar package, which is not "
                                                         "installed on this server (pip install xgrammar)") from None
        return xgrammar

    def compile(self, response_format: str):
        """A compiled grammar for a normalized response format; SamplingParamsError if the schema cannot be."""
        xgr = self._xgr()
        with self._lock:
            if self._compiler is None:
                try:
                    with self._tokenizer_lock:
                        info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                                  stop_token_ids=self._stop_ids)
                except Exception as e:  # noqa: BLE001 - a tokenizer xgrammar cannot read: the request, not a 500
                    raise SamplingParamsError("response_format", "response_format is not available for this "
                                                                 f"model's tokenizer: {e}"[:300]) from None
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
            spec = json.loads(response_format)
            schema = spec["json_schema"]["schema"] if spec["type"] == "json_schema" else {"type": "object"}
            try:
                return self._compiler.compile_json_schema(json.dumps(schema), any_whitespace=True)
            except Exception as e:  # noqa: BLE001 - xgrammar reports an unsupported schema as RuntimeError
                why = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
                raise SamplingParamsError("response_format", f"response_format schema is not supported: {why[:300]}") \
                    from None

    def matcher(self, compiled):
        return self._xgr().GrammarMatcher(compiled)


def fill_bitmask(matchers: list, vocab: int, device, ahead: list | None = None) -> Tensor:
    """(B, ceil(V / 32)) int32 bitmask, one row per sampled row: the matcher's allowed tokens, or every token for a
    row without one (None). ``ahead[i]``: drafted tokens row i's position follows (server/speculate.py): its
    matcher accepts them, fills the row and rolls back; a draft the grammar refuses leaves the row all ones (a
    row at or before it rejects that draft, so nothing drawn there is kept). Filled on the host (xgrammar's CPU
    matcher), copied once."""
    import xgrammar as xgr

    mask = xgr.allocate_token_bitmask(len(matchers), vocab)  # (B, W) int32, all ones
    for i, m in enumerate(matchers):
        if m is None:
            continue
        drafts = ahead[i] if ahead is not None else ()
        taken = 0
        for t in drafts:
            if m.matcher.is_terminated() or not m.matcher.accept_token(t):
                break
            taken += 1
        if taken == len(drafts):
            m.matcher.fill_next_token_bitmask(mask, i)
        if taken:
            m.matcher.rollback(taken)
    return mask.to(device, non_blocking=True)


class Matcher:
    """One sample's grammar state: the tokens it has accepted so far."""

    def __init__(self, grammars: Grammars, compiled):
        self.matcher = grammars.matcher(compiled)

    def accept(self, token: int) -> bool:
        return bool(self.matcher.accept_token(token))

    @property
    def terminated(self) -> bool:
        return bool(self.matcher.is_terminated())
