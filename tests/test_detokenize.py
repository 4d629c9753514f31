"""Streaming detokenization and stop strings (server/detokenize.py) with the real SmolLM2 tokenizer
(byte-level BPE): increments never split a character and join to tokenizer.decode, invalid byte streams,
special tokens, window size, stop-string matching rules. CPU only, a few seconds after the tokenizer loads."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.detokenize import MAX_PENDING, IncrementalDetokenizer, StopMatcher

pytestmark = pytest.mark.unit

FFFD = "\ufffd"

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces",
    "trailing spaces   ",
    "multiple   spaces  between    words",
    " ",
    "line one\nline two\n\n\nline five\r\n\ttabbed",
    "\n\n",
    "😀",
    "emoji 😀 in text 🎉🎉 and 🫠",
    "family 👨‍👩‍👧‍👦 and 👩🏽‍💻 ZWJ sequences",
    "flags 🇫🇷🇯🇵🇺🇸 and 🏴󠁧󠁢󠁳󠁣󠁴󠁿",
    "中文字符测试，这是一个句子。",
    "日本語のテキストです",
    "한국어 문장",
    "مرحبا بالعالم",
    "שלום עולם",
    "combining: e\u0301 a\u0300 n\u0303 Z\u0351\u0352\u0353",
    "café naïve résumé",
    "mixed: abc 中文 😀 مرحبا e\u0301 \U0001d54f 𝔘𝔫𝔦",
    "code: def f(x):\n    return x ** 2  # ok",
    "a . b , c ' s don't",
    "\ufffd literal replacement char",
    "ends with emoji 🧑‍🚀",
]

PROMPT = "<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[int]:
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    assert tokenizer.eos_token_id in ids or 1 in ids  # the chat markers parse as special tokens
    return ids


@pytest.fixture(scope="module")
def fragment_ids(tokenizer) -> list[int]:
    """Tokens that are not valid UTF-8 on their own (lone lead / continuation bytes, partial characters)."""
    return [i for i in range(len(tokenizer)) if FFFD in tokenizer.decode([i])]


def stream(tokenizer, ids, prompt=(), skip_special_tokens=True):
    det = IncrementalDetokenizer(tokenizer, list(prompt), skip_special_tokens=skip_special_tokens)
    pieces = [det.push(i) for i in ids]
    tail = det.flush()
    return det, pieces, tail


def check_stream(tokenizer, ids, prompt=(), skip_special_tokens=True):
    det, pieces, tail = stream(tokenizer, ids, prompt, skip_special_tokens)
    full = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "".join(pieces) + tail == full
    assert det.text == full
    for p in pieces:
        assert isinstance(p, str)
        p.encode("utf-8")  # no lone surrogates
        if FFFD not in full:
            assert FFFD not in p
    return pieces, tail


def test_decode_has_no_cleanup(tokenizer):
    # The detokenizer decodes windows with the tokenizer's defaults; for this tokenizer that means no
    # clean-up of spaces before punctuation, so the window difference is exact.
    ids = tokenizer.encode("a . b , c ' s n't", add_special_tokens=False)
    assert tokenizer.decode(ids) == "a . b , c ' s n't"


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("with_prompt", [False, True])
def test_stream_matches_decode(tokenizer, prompt_ids, text, with_prompt):
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces, tail = check_stream(tokenizer, ids, prompt_ids if with_prompt else ())
    assert "".join(pieces) + tail == text  # byte-level BPE round-trips
    if FFFD not in text:
        assert tail == ""  # a valid text is complete at its last token; nothing is held at the end


@pytest.mark.parametrize("text", ["😀", "emoji 😀 in text 🎉🎉", "family 👨‍👩‍👧‍👦", "flags 🇫🇷🇯🇵", "中文字符"])
def test_partial_characters_are_held_back(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    # Find the tokens that end inside a character: the decode of the ids so far ends with U+FFFD.
    splitting = [k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith(FFFD)]
    if not splitting:
        pytest.skip(f"{text!r} has no token ending inside a character")
    det = IncrementalDetokenizer(tokenizer, [])
    emitted, pieces = "", []
    for k, i in enumerate(ids, start=1):
        pieces.append(det.push(i))
        emitted += pieces[-1]
        if k in splitting:
            # The bytes of the last character are incomplete: nothing of it is shown...
            assert FFFD not in emitted
            assert tokenizer.decode(ids[:k]).startswith(emitted)
        else:
            # ...and once it completes, all text so far is out.
            assert emitted == tokenizer.decode(ids[:k])
    assert all(pieces[k - 1] == "" for k in splitting)  # a token ending inside a character shows nothing
    assert emitted == text and det.flush() == ""


def _pushes(tokenizer, ids):
    det = IncrementalDetokenizer(tokenizer, [])
    return [det.push(i) for i in ids]


def test_emoji_is_split_by_tokens(tokenizer):
    # The premise of the hold-back: this tokenizer spells 😀 (4 UTF-8 bytes) with several tokens.
    ids = tokenizer.encode("😀", add_special_tokens=False)
    assert len(ids) > 1
    assert _pushes(tokenizer, ids)[:-1] == [""] * (len(ids) - 1)
    assert _pushes(tokenizer, ids)[-1] == "😀"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=40), use_prompt=st.booleans())
def test_stream_matches_decode_hypothesis(tokenizer, text, use_prompt):
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = tokenizer.encode(PROMPT, add_special_tokens=False) if use_prompt else []
    check_stream(tokenizer, ids, prompt)


def test_the_default_tokenizer_ends_on_the_eos_its_config_names(tokenizer):
    """SmolLM2's GGUF names <|im_end|> (2) its EOS. transformers 5.17 (the GPU images') converts its tokenizer with
    <|im_start|> (1) instead; the conversion gives the tokenizer the config's tokens whichever made it."""
    import copy
    from types import SimpleNamespace

    from quant.format.sources import agree_special_tokens

    assert (tokenizer.eos_token, tokenizer.eos_token_id, tokenizer.bos_token_id) == ("<|im_end|>", 2, 1)
    tok = copy.deepcopy(tokenizer)
    tok.eos_token = "<|im_start|>"  # as 5.17 leaves it
    agree_special_tokens(tok, SimpleNamespace(bos_token_id=1, eos_token_id=2))
    assert (tok.eos_token, tok.eos_token_id, tok.bos_token_id) == ("<|im_end|>", 2, 1)
    agree_special_tokens(tok, SimpleNamespace(bos_token_id=None, eos_token_id=[2, 1]))  # a list: left as it is
    assert tok.eos_token_id == 2


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tokenizer, prompt_ids, skip):
    eos, im_start = tokenizer.eos_token_id, 1
    a = tokenizer.encode("Hello 😀", add_special_tokens=False)
    b = tokenizer.encode(" world 中文", add_special_tokens=False)
    # EOS in the middle of the text and between the bytes of a character.
    ids = a[:-1] + [eos] + a[-1:] + [eos, im_start] + b + [eos]
    pieces, tail = check_stream(tokenizer, ids, prompt_ids, skip_special_tokens=skip)
    out = "".join(pieces) + tail
    if skip:
        assert "<|" not in out
    else:
        assert out.count(tokenizer.eos_token) == 3 and "<|im_start|>" in out


@pytest.mark.parametrize("seed", range(30))
def test_random_ids(tokenizer, fragment_ids, seed):
    """Arbitrary ids, half of them byte fragments, so the stream is often invalid UTF-8."""
    rng = random.Random(seed)
    n = rng.choice([1, 5, 40, 120])
    ids = [rng.choice(fragment_ids) if rng.random() < 0.5 else rng.randrange(len(tokenizer)) for _ in range(n)]
    prompt = [rng.randrange(len(tokenizer)) for _ in range(rng.choice([0, 3, 20]))]
    for skip in (True, False):
        det, pieces, tail = stream(tokenizer, ids, prompt, skip)
        assert "".join(pieces) + tail == tokenizer.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("seed", range(10))
def test_invalid_runs(tokenizer, fragment_ids, seed):
    """Long runs of fragments and skipped specials exercise the forced progress for invalid tails."""
    rng = random.Random(1000 + seed)
    ids = []
    for _ in range(rng.randrange(1, 6)):
        ids += [rng.choice(fragment_ids) for _ in range(rng.randrange(1, 3 * MAX_PENDING))]
        ids += [rng.choice([0, 2]) for _ in range(rng.randrange(0, 3))]
        ids += tokenizer.encode(rng.choice(TEXTS), add_special_tokens=False)
    check_stream(tokenizer, ids, [])


class CountingTokenizer:
    """Wraps a tokenizer and records the longest id list passed to decode."""

    def __init__(self, tok):
        self.tok, self.longest, self.calls = tok, 0, 0

    def decode(self, ids, **kw):
        self.longest, self.calls = max(self.longest, len(ids)), self.calls + 1
        return self.tok.decode(ids, **kw)


@pytest.mark.parametrize("kind", ["text", "invalid"])
def test_decode_window_is_bounded(tokenizer, fragment_ids, prompt_ids, kind):
    # O(1) per token: no decode ever sees more than a short window, however long the stream.
    if kind == "text":
        ids = tokenizer.encode(" ".join(TEXTS) * 4, add_special_tokens=False)
    else:
        # Only continuation bytes: never valid, every decode ends with U+FFFD.
        cont = [i for i in fragment_ids if len(tokenizer.convert_ids_to_tokens(i)) == 1]
        ids = [cont[k % len(cont)] for k in range(600)]
    wrapped = CountingTokenizer(tokenizer)
    det = IncrementalDetokenizer(wrapped, prompt_ids * 50)
    pieces = [det.push(i) for i in ids]
    tail = det.flush()
    assert "".join(pieces) + tail == tokenizer.decode(ids)
    assert len(ids) > 500
    assert wrapped.longest <= 3 * MAX_PENDING
    assert wrapped.calls <= 4 * len(ids)
    if kind == "invalid":
        assert sum(1 for p in pieces if p) > len(ids) // (2 * MAX_PENDING)  # invalid bytes still flow


def test_flush_and_push_after_flush(tokenizer):
    ids = tokenizer.encode("😀", add_special_tokens=False)
    det = IncrementalDetokenizer(tokenizer, [])
    assert det.push(ids[0]) == ""
    out = det.flush()
    assert out == tokenizer.decode(ids[:1]) and FFFD in out  # an invalid tail comes out as decode shows it
    assert det.flush() == ""
    assert det.text == out
    with pytest.raises(RuntimeError):
        det.push(ids[1])


def test_prompt_ending_inside_a_character(tokenizer):
    ids = tokenizer.encode("ab😀cd", add_special_tokens=False)
    cut = next(k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith(FFFD))
    check_stream(tokenizer, ids[cut:], ids[:cut])


# ---------------------------------------------------------------------------------------------------- stops


def run_stops(stops, chunks):
    m = StopMatcher(tuple(stops))
    out, stopped = [], False
    for c in chunks:
        piece, stopped = m.push(c)
        out.append(piece)
        if stopped:
            break
    return "".join(out) + ("" if stopped else m.flush()), stopped, m


def all_splits(text, rng, n=20):
    yield [text]
    yield list(text)
    for _ in range(n):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randrange(0, len(text) - 1))) if len(text) > 1 else []
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def reference_stop(stops, text):
    """Character-by-character reference: the first stop to complete, longest among equal ends."""
    stops = [s for s in stops if s]
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            s = max(done, key=len)
            return text[: end - len(s)], True, s
    return text, False, None


def test_stop_split_across_increments():
    m = StopMatcher(("<END>",))
    assert m.push("Hello <") == ("Hello ", False)
    assert m.push("EN") == ("", False)
    assert m.push("D> ignored") == ("", True)
    assert m.matched == "<END>" and m.stopped
    assert m.push("more") == ("", True)
    assert m.flush() == ""


def test_held_prefix_released():
    m = StopMatcher(("<END>",))
    assert m.push("a <EN") == ("a ", False)
    assert m.push("X") == ("<ENX", False)  # not a stop after all
    assert m.push("<") == ("", False)
    assert m.push("<") == ("<", False)  # the new "<" may still start one
    assert m.flush() == "<"
    assert not m.stopped


def test_no_stops_passthrough():
    m = StopMatcher(())
    assert m.push("abc") == ("abc", False)
    assert m.push("") == ("", False)
    assert m.flush() == ""
    assert StopMatcher(("",)).push("abc") == ("abc", False)  # empty stops are ignored


def test_prefix_stops_first_to_complete_wins():
    # "\n" completes before "\n\n" can, so it is the match; the cut is the same.
    assert run_stops(("\n\n", "\n"), ["a\n\nb"])[:2] == ("a", True)
    assert run_stops(("\n\n", "\n"), ["a\n\nb"])[2].matched == "\n"
    # Same end: the longest wins, so no part of it leaks ("ab" ends where "b" ends).
    out, stopped, m = run_stops(("b", "ab"), ["xa", "b"])
    assert (out, stopped, m.matched) == ("x", True, "ab")
    # A longer stop that started earlier but is not complete loses to one that completes first.
    out, stopped, m = run_stops(("abcd", "bc"), ["abcd"])
    assert (out, stopped, m.matched) == ("a", True, "bc")


def test_overlapping_stops():
    out, stopped, m = run_stops(("aab", "abc"), ["xaa", "bc"])
    assert (out, stopped, m.matched) == ("x", True, "aab")
    out, stopped, m = run_stops(("aab", "abc"), ["xaa", "c"])
    assert (out, stopped) == ("xaac", False)
    out, stopped, m = run_stops(("abab",), ["ab", "a", "bab"])  # self-overlap
    assert (out, stopped) == ("", True)


def test_multibyte_stops():
    out, stopped, m = run_stops(("🛑", "。\n"), ["你好", "。", "\n再见"])
    assert (out, stopped, m.matched) == ("你好", True, "。\n")
    out, stopped, m = run_stops(("e\u0301!",), ["caf", "e", "\u0301", "!"])
    assert (out, stopped) == ("caf", True)
    out, stopped, m = run_stops(("👨‍👩‍👧",), ["x👨‍", "👩‍", "👦"])
    assert (out, stopped) == ("x👨‍👩‍👦", False)


@pytest.mark.parametrize("seed", range(40))
def test_stops_against_reference(seed):
    rng = random.Random(seed)
    alphabet = "ab\n😀é"
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 5))) for _ in range(rng.randrange(1, 4))]
    text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 30)))
    want, want_stopped, want_stop = reference_stop(stops, text)
    for chunks in all_splits(text, rng, n=5):
        m = StopMatcher(tuple(stops))
        seen = ""
        for c in chunks:
            piece, stopped = m.push(c)
            seen += piece
            # What is out never includes the start of a stop that completes later.
            assert want.startswith(seen)
            if stopped:
                break
        got = seen if m.stopped else seen + m.flush()
        assert (got, m.stopped, m.matched) == (want, want_stopped, want_stop), (stops, text, chunks)


# ------------------------------------------------------------------------------------------------- combined


@pytest.mark.parametrize(
    "text,stops",
    [
        ("Sure! Here it is.\n\nUser: next question", ("\n\nUser:",)),
        ("Count: 1, 2, 3 😀 done. 🛑 never shown", ("🛑",)),
        ("中文回答。结束后不显示", ("。",)),
        ("no stop in this text at all 👍", ("###", "<END>")),
        ("ends with a partial stop <EN", ("<END>",)),
    ],
)
def test_detokenizer_into_stop_matcher(tokenizer, prompt_ids, text, stops):
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    det = IncrementalDetokenizer(tokenizer, prompt_ids)
    m = StopMatcher(stops)
    out, n_used = "", 0
    for i in ids:
        n_used += 1
        piece, stopped = m.push(det.push(i))
        assert FFFD not in piece
        out += piece
        if stopped:
            break
    else:
        piece, _ = m.push(det.flush())
        out += piece + m.flush()
    want, want_stopped, _ = reference_stop(stops, text)
    assert out == want and m.stopped == want_stopped
    if want_stopped:
        assert n_used < len(ids)  # generation ends at the token that completes the stop
