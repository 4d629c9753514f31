"""`quant-client`: the command-line client of a quantserve server (gRPC by default, HTTP with --http).

Never imports torch, transformers or the server: it runs on a laptop against a remote server. Generated text
goes to stdout; summaries, progress and errors go to stderr, so ``quant-client generate ... > out.txt``
keeps only the text. A failed call prints one line, ``error: CODE: MESSAGE``, and exits with the code's
status (see EXIT_STATUS below and ``--help``).
"""

from __future__ import annotations

import argparse
import json
import sys
from types import MappingProxyType
from typing import Any, Callable, Mapping

from rich.console import Console

from quantserve.client.client import Client, default_target
from quantserve.client.errors import EXIT_CODES, EXIT_LOCAL, ClientError
from quantserve.client.types import SAMPLING_FIELDS, SAMPLING_TYPES, Message, RequestShape, parse_shape, to_dict

EPILOG = "exit status: 0 ok, 1 local problem (file, missing package), 2 bad command line, " + ", ".join(
    f"{v} {k}" for k, v in sorted(EXIT_CODES.items(), key=lambda kv: kv[1])) + "."
TRACE_MAX_NEW_TOKENS = 16  # trace prints one table per step: a short default keeps it readable


# ------------------------------------------------------------------------------------------ parser


def _connection_flags() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("server")
    g.add_argument("--target", help="host:port (default 127.0.0.1:50051, with --http 127.0.0.1:8000; --http also "
                                    "takes a URL)")
    g.add_argument("--http", action="store_true", help="use the OpenAI-compatible HTTP API instead of gRPC")
    g.add_argument("--tls", action="store_true", help="TLS (https / a secure gRPC channel)")
    g.add_argument("--ca-file", help="PEM CA bundle for --tls (implies --tls; default: the system's roots)")
    key = g.add_mutually_exclusive_group()
    key.add_argument("--api-key", help="sent as 'authorization: Bearer KEY'")
    key.add_argument("--api-key-file", help="read the API key from this file")
    g.add_argument("--timeout", type=float, default=120.0, help="seconds per call (default 120; 0 = no deadline)")
    return p


# The sampling flags are the fields of quantserve.client.types.Sampling; these have more to say than their name.
_SAMPLING_HELP = MappingProxyType({"stop": "a stop string (repeat for several)",
                                   "logprobs": "0..20: each token's logprob and this many alternatives",
                                   "logit_bias": "ID=BIAS: add BIAS (-100..100) to token ID's logit (repeat for "
                                                 "several)",
                                   "response_format": "OpenAI's response_format as JSON, e.g. "
                                                      "'{\"type\": \"json_object\"}'",
                                   "speculate": "--no-speculate: this request never drafts, whatever the server's "
                                                "--speculate (the tokens are the same either way)"})


def _bias_entry(text: str) -> tuple[int, float]:
    """``ID=BIAS`` of --logit-bias."""
    tok, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(tok), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ID=BIAS (an integer token id and a number), got {text!r}") from None


def _sampling_flags(max_new_tokens_default: int | None = None, logprobs: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("sampling (unset: the server's default)")
    for name in SAMPLING_FIELDS:
        if name == "trace" or (name == "logprobs" and not logprobs):  # trace: the trace command's --trace-n
            continue
        kind, kw = SAMPLING_TYPES[name], {"help": _SAMPLING_HELP.get(name)}
        if kind is bool:
            kw.update(action=argparse.BooleanOptionalAction, default=None)
        elif kind is tuple:
            kw.update(action="append")
        elif kind is dict:
            kw.update(action="append", type=_bias_entry, metavar="ID=BIAS")
        else:
            kw.update(type=kind)
        if name == "max_new_tokens" and max_new_tokens_default:
            kw.update(default=max_new_tokens_default, help=f"(default {max_new_tokens_default})")
        g.add_argument("--" + name.replace("_", "-"), **kw)
    return p


def build_parser() -> argparse.ArgumentParser:
    conn, samp = _connection_flags(), _sampling_flags()
    p = argparse.ArgumentParser(prog="quant-client", description="Client of a quantserve server.", epilog=EPILOG)
    p.add_argument("--version", action="version", version="quant-client 0.1.0")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def cmd(name: str, help: str, parents: list) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, parents=parents, epilog=EPILOG)

    for name, help in (("generate", "generate a completion; prints the text, then a summary line"),
                       ("stream", "stream a completion token by token, then a summary line")):
        c = cmd(name, help, [conn, samp])
        c.add_argument("prompt", help="the prompt text (with --ids: comma-separated token ids)")
        c.add_argument("--ids", action="store_true", help="PROMPT is a comma-separated list of token ids")
        if name == "generate":
            c.add_argument("--json", action="store_true", help="print the whole result as JSON")
            c.add_argument("--n", type=int, default=1, help="samples of the prompt (the server prefills it once; "
                                                            "sample i draws with seed + i; default 1)")
    c = cmd("chat", "chat: one user message per stdin line (the server applies the chat template); "
                    "'/exit' or end of input ends", [conn, samp])
    c.add_argument("--system", help="a system message to start the conversation with")
    c = cmd("info", "what is served: model, scheme, dtype, attention, device, memory, limits", [conn])
    c.add_argument("--json", action="store_true")
    c = cmd("plan", "capacity preflight: for requests of these shapes, KV per request, how many are guaranteed to "
                    "fit now and when idle, how many run at once at an expected length, the prefill activation "
                    "peak, and whether each sent now would be admitted, queued or refused (and why)", [conn])
    c.add_argument("--prompt-tokens", type=int, help="one shape: prompt tokens ...")
    c.add_argument("--max-new-tokens", type=int, help="... max new tokens ...")
    c.add_argument("--concurrency", type=int, default=1, help="... and how many such requests (default 1)")
    c.add_argument("--shape", action="append", metavar="PxN[xC[xS]][~E]", help="a shape as prompt x max-new "
                   "[x count [x samples]] [~ expected new tokens], e.g. 512x256x8 or 200x2048x8~300; repeat for "
                   "several, planned in the order given")
    c.add_argument("--json", action="store_true")
    c = cmd("tokenize", "the server tokenizer's ids and tokens for TEXT", [conn])
    c.add_argument("text")
    c.add_argument("--json", action="store_true")
    c = cmd("trace", "per generated step, the candidates after temperature, top-k and top-p and what each "
                     "control removed", [conn, _sampling_flags(TRACE_MAX_NEW_TOKENS, logprobs=False)])
    c.add_argument("prompt")
    c.add_argument("--trace-n", type=int, default=10, help="candidates per stage (1..50, default 10)")
    c.add_argument("--json", metavar="FILE", help="save the raw trace here (the input of 'plot --trace')")
    c.add_argument("--quiet", action="store_true", help="no tables (with --json)")
    c = cmd("sweep", "sampling sweep: every (temperature, top-k, top-p) x seeds, with diversity, likelihood, "
                     "entropy and memory metrics per cell", [conn])
    c.add_argument("prompt")
    c.add_argument("--temperature", default="0,0.7,1.0", help="comma-separated (default 0,0.7,1.0)")
    c.add_argument("--top-k", default="0,40", help="comma-separated (default 0,40)")
    c.add_argument("--top-p", default="1.0,0.9,0.5", help="comma-separated (default 1.0,0.9,0.5)")
    c.add_argument("--seeds", type=int, default=5, help="seeds 0..S-1 per cell (default 5)")
    c.add_argument("--max-new-tokens", type=int, help="(default: the server's)")
    c.add_argument("--concurrency", type=int, default=16, help="requests in flight, each a cell's seeds as n "
                                                                "samples (default 16)")
    c.add_argument("--csv", metavar="FILE", help="write one row per cell")
    c.add_argument("--json", metavar="FILE", help="write one row per cell (the input of 'plot --sweep')")
    c = cmd("plot", "PNG of a trace step (--trace) or of a sweep metric (--sweep); local, no server", [])
    src = c.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", metavar="FILE", help="a file from 'trace --json': probability mass per stage "
                                                     "(900x450 px)")
    src.add_argument("--sweep", metavar="FILE", help="a file from 'sweep --json' or '--csv': heatmaps over "
                                                     "(temperature, top-p), one per top-k ((450*panels)x400 px)")
    c.add_argument("--step", type=int, default=0, help="the trace step to plot (default 0)")
    c.add_argument("--metric", default="distinct_2", help="the sweep column to plot (default distinct_2)")
    c.add_argument("--out", required=True, metavar="PNG")
    return p


# ------------------------------------------------------------------------------------------ helpers


def _client(a: argparse.Namespace) -> Client:
    key = a.api_key
    if a.api_key_file:
        try:
            with open(a.api_key_file) as f:
                key = f.read().strip()
        except OSError as e:
            raise _Local(f"cannot read --api-key-file: {e}") from None
    return Client(a.target or default_target(a.http), http=a.http, tls=a.tls, ca_file=a.ca_file, api_key=key,
                  timeout=a.timeout or None)


def _sampling(a: argparse.Namespace) -> dict[str, Any]:
    out = {f: getattr(a, f) for f in SAMPLING_FIELDS if getattr(a, f, None) is not None}
    for f in out:
        if SAMPLING_TYPES[f] is dict:  # ID=BIAS pairs; a token named twice is the server's to refuse
            pairs = out[f]
            out[f] = dict(pairs)
            if len(out[f]) < len(pairs):
                raise _Local(f"--{f.replace('_', '-')}: a token id is given twice")
    return out


def _prompt(a: argparse.Namespace):
    if not getattr(a, "ids", False):
        return a.prompt
    try:
        return [int(x) for x in a.prompt.split(",") if x.strip()]
    except ValueError:
        raise _Local(f"--ids: PROMPT must be comma-separated integers, got {a.prompt!r}") from None


class _Local(Exception):
    """A problem on this side (a file, a missing package): one line, exit status 1."""


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


# ------------------------------------------------------------------------------------------ commands


def cmd_generate(a, out: Console, err: Console) -> None:
    with _client(a) as c:
        r = c.generate(_prompt(a), n=a.n, **_sampling(a))
    if a.json:
        _write(json.dumps(to_dict(r), indent=1) + "\n")
        return
    from quantserve.client.render import summary

    for i, s in enumerate(r.samples or (r,)):
        if r.samples:
            err.print(f"--- sample {i} (seed {s.seed})", markup=False, highlight=False, style="dim")
        _write(s.text + "\n")
        err.print(summary(s), markup=False, highlight=False, style="dim")


def cmd_stream(a, out: Console, err: Console) -> None:
    from quantserve.client.render import summary

    with _client(a) as c:
        for chunk in c.stream(_prompt(a), **_sampling(a)):
            _write(chunk.text)
            if chunk.result is not None:
                _write("\n")
                err.print(summary(chunk.result), markup=False, highlight=False, style="dim")


def cmd_chat(a, out: Console, err: Console) -> None:
    from quantserve.client.render import summary

    history = [Message("system", a.system)] if a.system else []
    interactive = sys.stdin.isatty()
    with _client(a) as c:
        while True:
            if interactive:
                err.print("you> ", end="", style="bold")
            line = sys.stdin.readline()
            if not line or line.strip() == "/exit":
                break
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            history.append(Message("user", line))
            reply: list[str] = []
            try:
                for chunk in c.chat_stream(history, **_sampling(a)):
                    _write(chunk.text)
                    reply.append(chunk.text)
                    if chunk.result is not None:
                        _write("\n")
                        err.print(summary(chunk.result), markup=False, highlight=False, style="dim")
            except ClientError as e:
                if not interactive:
                    raise
                history.pop()  # the turn failed: forget it and let the user go on
                err.print(f"error: {e}", markup=False, highlight=False, style="red")
                continue
            history.append(Message("assistant", "".join(reply)))


def cmd_info(a, out: Console, err: Console) -> None:
    with _client(a) as c:
        i = c.info()
    if a.json:
        _write(json.dumps(to_dict(i), indent=1) + "\n")
        return
    from quantserve.client.render import info_table

    out.print(info_table(i, "HTTP" if a.http else "gRPC"))


def _shapes(a) -> list[RequestShape] | None:
    if a.shape is None:
        if a.prompt_tokens is None or a.max_new_tokens is None:
            raise _Local("plan needs --prompt-tokens and --max-new-tokens, or --shape PxN[xC]")
        return None
    if a.prompt_tokens is not None or a.max_new_tokens is not None:
        raise _Local("give --shape or --prompt-tokens/--max-new-tokens, not both")
    try:
        return [parse_shape(t) for t in a.shape]
    except ValueError as e:
        raise _Local(f"--shape: {e}") from None


def cmd_plan(a, out: Console, err: Console) -> None:
    shapes = _shapes(a)
    with _client(a) as c:
        p = (c.plan(prompt_tokens=a.prompt_tokens, max_new_tokens=a.max_new_tokens, concurrency=a.concurrency)
             if shapes is None else c.plan(shapes))
    if a.json:
        _write(json.dumps(to_dict(p), indent=1) + "\n")
        return
    from quantserve.client.render import plan_table

    out.print(plan_table(p, "HTTP" if a.http else "gRPC"))


def cmd_tokenize(a, out: Console, err: Console) -> None:
    with _client(a) as c:
        t = c.tokenize(a.text)
    if a.json:
        _write(json.dumps(to_dict(t), indent=1) + "\n")
        return
    _write(" ".join(f"{i}:{tok!r}" for i, tok in zip(t.token_ids, t.tokens)) + "\n")


def cmd_trace(a, out: Console, err: Console) -> None:
    from quantserve.client.render import summary, trace_table

    with _client(a) as c:
        # logprobs=0 gives the drawn token's text and logprob at every step
        r = c.generate(a.prompt, **{**_sampling(a), "trace": a.trace_n, "logprobs": 0})
    if a.json:
        doc = {"prompt": a.prompt, "transport": r.transport, "sampling": {**_sampling(a), "trace": a.trace_n},
               "seed": r.seed, "text": r.text, "token_ids": r.token_ids, "tokens": [lp.token for lp in r.logprobs],
               "logprobs": [lp.logprob for lp in r.logprobs], "trace": to_dict(r.trace)}
        try:
            with open(a.json, "w") as f:
                json.dump(doc, f, indent=1)
        except OSError as e:
            raise _Local(f"cannot write {a.json}: {e}") from None
    if not a.quiet:
        for i, step in enumerate(r.trace):
            out.print(trace_table(i, step, r.logprobs[i] if i < len(r.logprobs) else None, a.trace_n))
        _write(r.text + "\n")
    err.print(summary(r), markup=False, highlight=False, style="dim")


def cmd_sweep(a, out: Console, err: Console) -> None:
    from quantserve.client import sweep as sw
    from quantserve.client.render import sweep_table

    try:
        spec = sw.SweepSpec(prompt=a.prompt, temperatures=sw.parse_list(a.temperature, float, "temperature"),
                            top_ks=sw.parse_list(a.top_k, int, "top-k"), top_ps=sw.parse_list(a.top_p, float, "top-p"),
                            seeds=a.seeds, max_new_tokens=a.max_new_tokens, concurrency=a.concurrency)
    except ValueError as e:
        raise _Local(str(e)) from None
    with _client(a) as c:
        with err.status(f"sweep: {spec.requests} requests") as status:
            rows = sw.run_sweep(c, spec, lambda done, n: status.update(f"sweep: {done}/{n} requests"))
    transport = "http" if a.http else "grpc"
    out.print(sweep_table(rows, spec.seeds, transport))
    try:
        if a.csv:
            sw.write_csv(rows, a.csv)
        if a.json:
            sw.write_json(rows, a.json, spec, transport)
    except OSError as e:
        raise _Local(f"cannot write the sweep file: {e}") from None


def cmd_plot(a, out: Console, err: Console) -> None:
    try:
        from quantserve.client import plot
        import matplotlib  # noqa: F401 - only to give a clear message when it is missing
    except ImportError:
        raise _Local("plot needs matplotlib: pip install 'quantserve-client[plot]'") from None
    try:
        if a.trace:
            steps, tokens, doc = plot.load_trace(a.trace)
            if not 0 <= a.step < len(steps):
                raise _Local(f"--step must be in [0, {len(steps)}) for {a.trace}, got {a.step}")
            drew = f" · drew {tokens[a.step]!r}" if a.step < len(tokens) else ""
            plot.plot_trace_step(steps[a.step], a.out, f"step {a.step}{drew} · sampling {doc.get('sampling', {})}")
            w, h = plot.trace_png_size()
        else:
            from quantserve.client.sweep import read_rows

            panels = plot.plot_sweep(read_rows(a.sweep), a.metric, a.out)
            w, h = plot.sweep_png_size(panels)
    except (OSError, ValueError, KeyError) as e:
        raise _Local(f"{type(e).__name__}: {e}" if isinstance(e, KeyError) else str(e)) from None
    err.print(f"wrote {a.out} ({w}x{h} px)", markup=False, highlight=False)


COMMANDS: Mapping[str, Callable[[argparse.Namespace, Console, Console], None]] = MappingProxyType({
    "generate": cmd_generate, "stream": cmd_stream, "chat": cmd_chat, "info": cmd_info, "plan": cmd_plan,
    "tokenize": cmd_tokenize,
    "trace": cmd_trace, "sweep": cmd_sweep, "plot": cmd_plot,
})


def _consoles() -> tuple[Console, Console]:
    # Resolved per call (tests swap sys.stdout); wide when not a terminal so tables do not wrap in files.
    out, err = Console(file=sys.stdout), Console(file=sys.stderr)
    for c in (out, err):
        if not c.is_terminal:
            c.width = 160
    return out, err


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    out, err = _consoles()

    def fail(msg: str, status: int) -> int:
        err.print(f"error: {msg}", markup=False, highlight=False, soft_wrap=True)
        return status

    try:
        COMMANDS[a.command](a, out, err)
    except ClientError as e:
        extra = f" (parameter: {e.param})" if e.param and e.param not in e.message else ""
        return fail(f"{e}{extra}", e.exit_code)
    except _Local as e:
        return fail(str(e), EXIT_LOCAL)
    except (ValueError, OSError) as e:  # refused before sending (a negative --timeout, an unreadable --ca-file)
        return fail(str(e), EXIT_LOCAL)
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
