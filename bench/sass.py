"""The project's Triton kernels compiled for a GPU on a machine without one, and what the compiler made of them.

Triton's interpreter (the CPU tests) checks what a kernel computes, not whether it compiles for a GPU, how many
registers it takes, whether it spills, or what its inner loop issues. Triton's compiler needs no GPU for any of
that: it lowers a kernel to PTX and assembles it with the ptxas of its own wheel for any target. So here every
launch the engine makes goes through the project's own wrappers with CPU tensors, under a compile-only Triton
driver: a launch compiles its kernel for the target (sm_90, an H100, unless told) with the specialisation a GPU
launch would get (the same arguments: dtypes, values, 16-byte alignment) and returns without running it.

For each compiled kernel: registers, spilled bytes (local memory), shared memory against the target's limit,
and the innermost loop of its SASS (instructions per iteration and by opcode). For the one-row kernels of the
int4 and int8 Linears that loop is a static figure of merit: instructions issued per weight, which bound the
kernel's speed when they exceed what the memory's bandwidth leaves time for. It is not a timing.

    python bench/sass.py                      # every case, sm_90: a table
    python bench/sass.py --arch 80 --check    # exit 1 if any kernel fails to compile, spills or overflows shared
    python bench/sass.py --only gemv --json out.json
    python bench/sass.py --only gemv attention prior --no-axes   # beside what the present kernels replaced

tests/test_triton_compile.py runs ``--check`` for sm_90 and sm_80 in CI.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Shared memory one block may use (opt-in maximum), by compute capability: what Triton's launcher checks a
# kernel's shared memory against on that GPU.
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}


@dataclass
class Compiled:
    case: str  # what was launched (wrapper, shape, dtype)
    kernel: str
    arch: int
    constants: dict
    num_warps: int
    registers: int = 0
    spilled_bytes: int = 0  # local memory per thread: registers spilled (or arrays the compiler could not keep)
    shared_bytes: int = 0
    loop_instructions: int = 0  # the innermost loop's instructions per iteration (0: no loop)
    loop_ops: dict = field(default_factory=dict)
    error: str = ""

    def problems(self) -> list[str]:
        out = []
        if self.error:
            out.append(f"does not compile: {self.error}")
        if self.spilled_bytes:
            out.append(f"spills {self.spilled_bytes} bytes per thread to local memory")
        limit = SHARED_LIMIT.get(self.arch)
        if limit is not None and self.shared_bytes > limit:
            out.append(f"needs {self.shared_bytes} bytes of shared memory, sm_{self.arch} allows {limit}")
        return out


# --------------------------------------------------------------------------------------------- compile-only driver

class _CompileOnlyDriver:
    """What Triton's JIT asks of the active driver before it compiles: the target, a device and a stream."""

    def __init__(self, target):
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def map_python_to_cpp_type(self, ty):  # the launcher's (never built here)
        return ty


@contextlib.contextmanager
def compile_only(arch: int = 90):
    """Within: a Triton launch compiles its kernel for sm_``arch`` and returns without running it; yields the list
    the compiled kernels are appended to, as (kernel name, CompiledKernel)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("compile_only needs Triton's compiler: unset TRITON_INTERPRET")
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    compiled: list = []
    run = JITFunction.run

    def compile_launch(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.fn.__name__, kernel))
        return kernel

    from quant.runtime.kernels import triton_ops

    saved = driver._active
    driver.set_active(_CompileOnlyDriver(GPUTarget("cuda", arch, 32)))
    JITFunction.run = compile_launch
    rules = triton_ops.capability
    triton_ops.capability = lambda device: divmod(arch, 10)  # the wrappers choose tiles by the target's capability
    try:
        yield compiled
    finally:
        JITFunction.run = run
        triton_ops.capability = rules
        driver._active = saved  # None here: no GPU driver to fall back to


def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def inspect(kernel, case: str, name: str, arch: int) -> Compiled:
    """Registers, spills and shared memory of a compiled kernel (cuobjdump), and its innermost loop (nvdisasm)."""
    md = kernel.metadata
    src = getattr(kernel, "src", None)
    names = getattr(getattr(src, "fn", None), "arg_names", [])
    consts = {}
    for key, val in (getattr(src, "constants", None) or {}).items():  # keyed by (argument index,)
        i = key[0] if isinstance(key, tuple) and len(key) == 1 else None
        if isinstance(val, (int, float, bool, str)):
            consts[names[i] if i is not None and i < len(names) else str(key)] = val
    c = Compiled(case, name, arch, consts, md.num_warps, shared_bytes=md.shared)
    read = _read_cubin(kernel.asm["cubin"], name)
    c.registers, c.spilled_bytes = read["registers"], read["stack"] + read["local"]
    if read["loop"]:
        c.loop_instructions = sum(read["loop"].values())
        c.loop_ops = dict(collections.Counter(read["loop"]).most_common())
    return c


def _read_cubin(cubin: bytes, name: str) -> dict:
    """What cuobjdump (registers, stack, local memory) and nvdisasm (the innermost loop's opcodes) read from a cubin.
    Kept per machine under the quantserve cache, by the digest of the cubin and of the tools: nvdisasm takes ~0.25
    s a kernel, most of a ``--check`` whose kernels Triton's own cache hands back compiled."""
    from quant.format.sources import default_cache_dir

    tools = [Path(_tool(t)) for t in ("cuobjdump", "nvdisasm")]
    digest = hashlib.sha256(cubin)
    for t in tools:
        st = t.stat()
        digest.update(f"{t}:{st.st_size}:{st.st_mtime_ns}".encode())
    kept = default_cache_dir() / "sass" / f"{digest.hexdigest()}.json"
    if kept.is_file():
        try:
            return json.loads(kept.read_text())
        except ValueError:
            pass  # damaged: read the cubin again
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        usage = subprocess.run([str(tools[0]), "--dump-resource-usage", path], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([str(tools[1]), "-c", path], capture_output=True, text=True, check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage)
    if m is None:
        raise RuntimeError(f"cuobjdump printed no resource usage for {name}")
    registers, stack, _, local = (int(g) for g in m.groups())
    loop = innermost_loop(sass)
    read = {"registers": registers, "stack": stack, "local": local, "loop": dict(loop) if loop else None}
    kept.parent.mkdir(parents=True, exist_ok=True)
    tmp = kept.with_name(f".{kept.name}.{os.getpid()}")
    tmp.write_text(json.dumps(read))
    tmp.replace(kept)
    return read


def innermost_loop(sass: str) -> collections.Counter | None:
    """Opcodes of the shortest backward-branch loop in nvdisasm's listing, or None without one."""
    labels: dict[str, int] = {}
    ops: list[str] = []
    best = None
    for line in sass.splitlines():
        lab = re.match(r"^\s*(\.L_x_\d+):", line)
        if lab:
            labels[lab.group(1)] = len(ops)
            continue
        if "/*" not in line or ";" not in line:
            continue
        body = line.split("*/", 1)[1].split(";")[0].strip()
        if not body:
            continue
        toks = body.split()
        ops.append(toks[1] if toks[0].startswith("@") else toks[0])
        br = re.search(r"BRA `\((\.L_x_\d+)\)", body)
        if br and labels.get(br.group(1), len(ops)) < len(ops) - 1:
            start = labels[br.group(1)]
            if best is None or len(ops) - start < best[1] - best[0]:
                best = (start, len(ops))
    return None if best is None else collections.Counter(ops[best[0]:best[1]])


# --------------------------------------------------------------------------------------------------- the launches

# (name, N, K, group size) of the one-row products: the default model's (SmolLM2-135M, g64) and Llama-3-8B's (g128)
LINEARS = (("135M qkv", 960, 576, 64), ("135M gate_up", 3072, 576, 64), ("135M down", 576, 1536, 64),
           ("8B qkv", 6144, 4096, 128), ("8B o", 4096, 4096, 128), ("8B gate_up", 28672, 4096, 128),
           ("8B down", 4096, 14336, 128))


def _w4(n, k, g, dtype):
    import torch

    return torch.zeros(k // 8, n, dtype=torch.int32), torch.zeros(k // g, n, 2, dtype=dtype)


def gemv_cases(dtype_name: str = "bfloat16", axes: bool = True) -> list[tuple[str, Callable[[], object], dict]]:
    """The one-row W4A16 and int8 kernels: each Linear at its rule's launch, and (``axes``) the 8B gate_up at every
    value of each axis a GPU's launch search tries from there. The dict says how many weights a thread takes per
    iteration of the K loop (for instructions per weight)."""
    import torch

    from quant.runtime.kernels import triton_ops as T

    dt = getattr(torch, dtype_name)
    cases = []

    def add(label, n, k, g, cfg, kind, gated=None, normed=None):
        bn, bk, split, warps = cfg
        per_thread = {"weights_per_thread": bn * bk / (32 * warps)}
        act = f" gated {gated}" if gated else ""  # a [gate | up] projection ending in act(gate) * up
        norm = None
        if normed:  # o and down ending in the residual add and the next norm ("all": Gemma's output norm and
            z = torch.zeros(n, dtype=dt)  # Granite's multiplier before the add too: every step of the epilogue)
            act += " + add & norm" if normed == "next" else " + out norm, scale, add & norm"
            norm = T.AddNorm(torch.zeros(1, n, dtype=dt), z, 1e-5, *(((z, 1e-6), 0.5) if normed == "all" else ()))
        if kind.startswith("w4"):
            qw, sz = _w4(n, k, g, dt)
            sym = kind.endswith("symmetric")  # zeros all 0: the kernel skips them
            cases.append((f"w4_gemv{' symmetric' if sym else ''}{act} {label} {cfg} {dtype_name}",
                          lambda: T.w4_gemv(torch.zeros(1, k, dtype=dt), qw, sz, g, cfg, sym, gated, norm),
                          per_thread))
        else:
            w = torch.zeros(n, k, dtype=torch.int8)
            s = torch.zeros(n, dtype=torch.float32)
            cases.append((f"int8_gemv{act} {label} {cfg} {dtype_name}",
                          lambda: T.int8_gemv(torch.zeros(1, k, dtype=dt), w, s, None, cfg, gated, norm), per_thread))

    for label, n, k, g in LINEARS:
        add(label, n, k, g, T.w4_gemv_config(n, k, g), "w4")
        add(label, n, k, g, T.w4_gemv_config(n, k, g), "w4 symmetric")
        add(label, n, k, g, T.int8_gemv_config(n, k), "int8")
        if label.endswith("gate_up"):  # as a decode step launches it: with the activation in its epilogue
            add(label, n, k, g, T.w4_gemv_config(n, k, g), "w4", "silu_mul")
            add(label, n, k, g, T.w4_gemv_config(n, k, g), "w4 symmetric", "gelu_tanh_mul")
            add(label, n, k, g, T.int8_gemv_config(n, k), "int8", "silu_mul")
        if label.endswith((" o", " down")):  # with the residual add and the next norm in its epilogue
            add(label, n, k, g, T.w4_gemv_config(n, k, g), "w4 symmetric", normed="next")
            add(label, n, k, g, T.int8_gemv_config(n, k), "int8", normed="next")
        if label.endswith(" down"):
            add(label, n, k, g, T.w4_gemv_config(n, k, g), "w4 symmetric", normed="all")
            add(label, n, k, g, T.int8_gemv_config(n, k), "int8", normed="all")
    if axes:
        label, n, k, g = LINEARS[5]
        for kind, (start, values) in (("w4", T.w4_gemv_space(n, k, g)), ("int8", T.int8_gemv_space(n, k))):
            seen = {start}
            for i, vals in enumerate(values):
                for v in vals:
                    cfg = start[:i] + (v,) + start[i + 1:]
                    if kind == "w4" and T.w4_gemv_words_per_thread(cfg) > T.GEMV_MAX_WORDS_PER_THREAD:
                        continue  # the wrapper refuses it (it spills), so the search never times it
                    if cfg not in seen:
                        seen.add(cfg)
                        add(label, n, k, g, cfg, kind)
    return cases


def prior_cases(dtype_name: str = "bfloat16") -> list[tuple[str, Callable[[], object], dict]]:
    """What the present kernels replaced and still offer, for a same-run comparison: the tiled W4A16 kernel over
    whole weights at the row counts the code planes took over, and the attention kernel stepping one page of keys
    at a time."""
    import torch

    from quant.runtime.kernels import triton_ops as T

    dt = getattr(torch, dtype_name)
    cases = []
    for label, n, k, g in (LINEARS[5], LINEARS[6]):  # the tiled kernel over whole weights, where planes now run
        qw, sz = _w4(n, k, g, dt)
        for rows in (16, 32, 64):
            cases.append((f"w4_matmul whole weights {label} {rows} rows {dtype_name}",
                          lambda rows=rows, qw=qw, sz=sz, n=n, k=k, g=g:
                          T._launch("w4_kernel", torch.zeros(rows, k, dtype=dt), n, k, 128, qw, sz, GS=g),
                          {"tile_weights": True}))
    return cases + attention_cases(dtype_name, keys_per_step=16)


def product_cases(dtype_name: str = "bfloat16") -> list[tuple[str, Callable[[], object], dict]]:
    """The tiled int4 and int8 kernels at the row counts the engine sends them, and the int4 dequantizer."""
    import torch

    from quant.runtime.kernels import triton_ops as T

    dt = getattr(torch, dtype_name)
    cases = []
    for label, n, k, g in (LINEARS[1], LINEARS[5], LINEARS[6]):
        qw, sz = _w4(n, k, g, dt)
        w = torch.zeros(n, k, dtype=torch.int8)
        s, z = torch.zeros(n, dtype=torch.float32), torch.zeros(n, dtype=torch.int8)
        for rows, zero_free in ((16, False), (16, True), (32, False), (32, True), (64, False), (64, True)):
            sym = " symmetric" if zero_free else ""
            cases.append((f"w4_matmul{sym} {label} {rows} rows {dtype_name}",
                          lambda rows=rows, qw=qw, sz=sz, k=k, g=g, zf=zero_free:
                          T.w4_matmul(torch.zeros(rows, k, dtype=dt), qw, sz, g, zero_free=zf),
                          {"tile_weights": True}))
        for rows in (16, 256):
            cases.append((f"int8_gemm affine {label} {rows} rows {dtype_name}",
                          lambda rows=rows, w=w, s=s, z=z, k=k: T.int8_gemm(torch.zeros(rows, k, dtype=dt), w, s, z),
                          {}))
        cases.append((f"w4_dequant {label} {dtype_name}", lambda qw=qw, sz=sz, g=g: T.w4_dequant(qw, sz, g, dt), {}))
    return cases


def attention_cases(dtype_name: str = "bfloat16",
                    keys_per_step: int | None = None) -> list[tuple[str, Callable[[], object], dict]]:
    """The paged attention kernel (decode with and without split keys, with the rotary and cache write fused as the
    engine launches it, and Qwen3's q/k head norms; a prefill chunk; soft-capping and a window) with its splits' merge, at the default model's heads (9/3 x 64), Llama-3-8B's (32/8 x 128) and Gemma 2's
    (8/4 x 256); ``keys_per_step`` overrides the kernel's rule (16: one page per step). The dict gives the keys a
    step of the key loop takes (for instructions per key)."""
    import torch

    from server.attention.base import AttentionSpec
    from server.attention.triton_paged import TritonMeta, paged_attention, step_keys

    dt = getattr(torch, dtype_name)
    cases = []
    block = 16
    for label, h, hkv, d, softcap, window in (("135M", 9, 3, 64, None, None), ("8B", 32, 8, 128, None, None),
                                              ("gemma2", 8, 4, 256, 50.0, 4096)):
        spec = AttentionSpec(h, hkv, d, d ** -0.5, window, softcap)
        kc = torch.zeros(64 * block, hkv, d, dtype=dt)
        for what, seqs, q_len, splits in (("decode", 1, 1, 16), ("decode", 64, 1, 1), ("prefill", 1, 512, 1)):
            t = seqs * q_len
            meta = TritonMeta(slots=torch.zeros(t, dtype=torch.int64), meta=torch.zeros(3, seqs, dtype=torch.int32),
                              tables=torch.zeros(seqs, 64, dtype=torch.int32), seqs=seqs, max_q=q_len,
                              max_ctx=64 * block, splits=splits)
            keys = keys_per_step or step_keys(block, d, q_len * (h // hkv))
            # decode steps as the engine launches them: the rotary and the cache write in the kernel
            rope = None if what == "prefill" else (torch.zeros(t, hkv, d, dtype=dt), torch.zeros(t, hkv, d, dtype=dt),
                                                   torch.zeros(t, d, dtype=dt), torch.zeros(t, d, dtype=dt))
            cases.append((f"paged_attention {what} {label} {seqs} seqs x {q_len} splits {splits} {keys} keys a step "
                          f"{dtype_name}", lambda t=t, spec=spec, kc=kc, meta=meta, h=h, d=d, keys=keys, rope=rope:
                          paged_attention(torch.zeros(t, h, d, dtype=dt), kc, kc, meta, spec, block, keys, rope),
                          {"keys_per_step": keys}))
            if rope is not None and label == "8B":  # Qwen3-8B's heads: the q/k norms in the kernel too
                norms = (torch.zeros(d, dtype=dt), torch.zeros(d, dtype=dt), 1e-6)
                cases.append((f"paged_attention {what} {label} with q/k head norms {seqs} seqs x {q_len} splits "
                              f"{splits} {keys} keys a step {dtype_name}",
                              lambda t=t, spec=spec, kc=kc, meta=meta, h=h, d=d, keys=keys, rope=rope, norms=norms:
                              paged_attention(torch.zeros(t, h, d, dtype=dt), kc, kc, meta, spec, block, keys, rope,
                                              norms), {"keys_per_step": keys}))
    return cases


def glue_cases(dtype_name: str = "bfloat16") -> list[tuple[str, Callable[[], object], dict]]:
    """The per-layer glue: (add +) RMSNorm, the rotary (with the K/V write, and partial), the K/V write, the gated
    activations."""
    import torch

    from server import glue_triton as G

    dt = getattr(torch, dtype_name)
    cases = []
    for label, hidden, inter, h, hkv, d, rot in (("135M", 576, 1536, 9, 3, 64, 64),
                                                 ("8B", 4096, 14336, 32, 8, 128, 128),
                                                 ("phi partial", 3072, 8192, 32, 32, 96, 32)):
        t = 4
        x = torch.zeros(t, hidden, dtype=dt)
        w = torch.zeros(hidden, dtype=dt)
        q, k, v = (torch.zeros(t, n, d, dtype=dt) for n in (h, hkv, hkv))
        cos = torch.zeros(t, rot, dtype=dt)
        kv = torch.zeros(2, 64, hkv, d, dtype=dt)
        slots = torch.zeros(t, dtype=torch.int64)
        gu = torch.zeros(t, 2 * inter, dtype=dt)
        cases += [
            (f"rms_norm {label} {dtype_name}", lambda x=x, w=w: G.rms_norm(x, w, 1e-6), {}),
            (f"add_rms_norm {label} {dtype_name}", lambda x=x, w=w: G.add_rms_norm(x, x, w, 1e-6), {}),
            (f"rope_ {label} {dtype_name}", lambda q=q, k=k, cos=cos: G.rope_(q, k, cos, cos), {}),
            (f"rope_store_kv_ {label} {dtype_name}",
             lambda q=q, k=k, v=v, cos=cos, kv=kv, slots=slots: G.rope_store_kv_(q, k, v, cos, cos, kv, slots), {}),
            (f"store_kv {label} {dtype_name}", lambda k=k, v=v, kv=kv, slots=slots: G.store_kv(k, v, kv, slots), {}),
            (f"silu_mul {label} {dtype_name}", lambda gu=gu: G.silu_mul(gu), {}),
            (f"gelu_tanh_mul {label} {dtype_name}", lambda gu=gu: G.gelu_tanh_mul(gu), {}),
        ]
    return cases


GROUPS = {"gemv": gemv_cases, "products": product_cases, "attention": attention_cases, "glue": glue_cases,
          "prior": prior_cases}
DEFAULT_GROUPS = ("attention", "gemv", "glue", "products")  # "prior": what the present kernels replaced


def compile_cases(cases, arch: int) -> list[Compiled]:
    out = []
    for case, launch, extra in cases:
        with compile_only(arch) as compiled:
            try:
                launch()
            except Exception as e:  # a kernel the compiler refuses: reported as such, the rest go on
                out.append(Compiled(case, "?", arch, {}, 0, error=f"{type(e).__name__}: {str(e).splitlines()[0]}"))
                continue
        for name, kernel in compiled:
            c = inspect(kernel, case, name, arch)
            per_thread = extra.get("weights_per_thread")
            if extra.get("tile_weights") and "BLOCK_K" in c.constants:  # a tiled kernel's: its tile over its threads
                per_thread = c.constants["BLOCK_N"] * c.constants["BLOCK_K"] / (32 * c.num_warps)
            if per_thread and c.loop_instructions:
                c.loop_ops["per_weight"] = round(c.loop_instructions / per_thread, 2)
            if extra.get("keys_per_step") and c.loop_instructions and name == "paged_attention":
                c.loop_ops["per_key"] = round(c.loop_instructions / extra["keys_per_step"], 2)
            out.append(c)
    return out


def table(results: list[Compiled]) -> str:
    lines = ["| case | kernel | sm | warps | registers | spilled B | shared B | loop instr | per weight or key | "
             "loop BAR |", "|---|---|---|---|---|---|---|---|---|---|"]
    for c in results:
        per = c.loop_ops.get("per_weight", c.loop_ops.get("per_key", ""))
        lines.append(f"| {c.case} | {c.kernel} | {c.arch} | {c.num_warps} | {c.registers} | {c.spilled_bytes} | "
                     f"{c.shared_bytes} | {c.loop_instructions or ''} | {per} | "
                     f"{c.loop_ops.get('BAR.SYNC.DEFER_BLOCKING', '') if c.loop_instructions else ''} |"
                     + (f" {c.error}" if c.error else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, nargs="+", default=[90], help="compute capabilities (90: H100, 80: A100)")
    ap.add_argument("--only", nargs="+", choices=sorted(GROUPS), default=list(DEFAULT_GROUPS))
    ap.add_argument("--dtype", nargs="+", default=["bfloat16"], choices=["bfloat16", "float16"])
    ap.add_argument("--no-axes", action="store_true", help="the one-row kernels at their rules' launches only")
    ap.add_argument("--check", action="store_true", help="exit 1 if a kernel fails to compile, spills or overflows")
    ap.add_argument("--json", help="write every result here")
    args = ap.parse_args(argv)
    results = []
    for arch in args.arch:
        for dtype in args.dtype:
            for group in args.only:
                cases = gemv_cases(dtype, not args.no_axes) if group == "gemv" else GROUPS[group](dtype)
                results += compile_cases(cases, arch)
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=1))
    bad = [(r, p) for r in results for p in r.problems()]
    for r, p in bad:
        print(f"PROBLEM sm_{r.arch} {r.case} ({r.kernel}): {p}")
    print(f"{len(results)} kernels compiled for sm_{'/'.join(map(str, args.arch))}; {len(bad)} problems")
    return 1 if args.check and bad else 0


if __name__ == "__main__":
    sys.exit(main())
