"""Every Triton kernel the engine launches compiles for an H100 (sm_90) and an A100 (sm_80) without spilling
registers or overflowing shared memory, checked on this CPU by Triton's own compiler (bench/sass.py, run as a
script: the project's wrappers called with CPU tensors under a compile-only driver). The interpreter tests hold
what the kernels compute; this holds that a GPU can run them, which the interpreter never checks."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
KERNEL_MODULES = ("quant/runtime/kernels/triton_kernels.py", "server/attention/triton_kernels.py", "server/glue_triton.py")

pytest.importorskip("triton")


def _launched_kernels() -> set[str]:
    """The @triton.jit functions of the kernel modules that no other kernel calls: the ones launched."""
    names, sources = set(), ""
    for rel in KERNEL_MODULES:
        src = (ROOT / rel).read_text()
        sources += src
        names |= set(re.findall(r"@triton\.jit\s*\ndef (\w+)\(", src))
    calls = re.sub(r"def \w+\(", "", sources)  # a launch is name[grid](...), a call name(...)
    return {n for n in names if not re.search(rf"(?<![\w.]){n}\(", calls)}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> list[dict]:
    """bench/sass.py --check in three processes side by side (each compiles on one core): every kernel for sm_90,
    the one-row kernels at every launch a GPU's search tries first; for sm_80 all but the per-layer glue (one
    program per row, no tl.dot, no shared memory to speak of: what differs between the targets does not reach
    them)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    tmp = tmp_path_factory.mktemp("sass")
    procs = []
    runs = (["--arch", "90", "--only", "gemv"], ["--arch", "90", "--only", "products", "attention", "glue"],
            ["--arch", "80", "--no-axes", "--only", "gemv", "products", "attention"])
    for i, args in enumerate(runs):
        out = tmp / f"sass{i}.json"
        procs.append((out, subprocess.Popen([sys.executable, str(ROOT / "bench" / "sass.py"), "--check", "--json",
                                             str(out), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                            text=True, env=env, cwd=ROOT)))
    results = []
    for out, p in procs:
        stdout, stderr = p.communicate(timeout=1200)
        assert p.returncode == 0, (stdout[-3000:], stderr[-3000:])
        results += json.loads(out.read_text())
    return results


def test_every_launched_kernel_compiles_for_an_h100_and_an_a100(compiled):
    assert not [r for r in compiled if r["error"] or r["spilled_bytes"]]  # --check's exit code says so too
    assert {r["kernel"] for r in compiled if r["arch"] == 90} == _launched_kernels(), \
        "bench/sass.py's cases miss a kernel, or name one gone"
    assert {r["kernel"] for r in compiled if r["arch"] == 80} == _launched_kernels() - {
        "_norm_kernel", "_rope_kernel", "_store_kv_kernel", "_act_mul_kernel"}


def test_the_one_row_int4_kernel_issues_few_instructions_per_weight(compiled):
    """The one-row W4A16 kernel's K loop, at every launch a GPU's search tries first: a static bound on its speed.
    An H100 issues 132 x 4 warp instructions per clock; while its 3.35 TB/s bring in a g128 weight (0.53 bytes with
    its share of the table) a 1.98 GHz clock leaves ~5.3 instructions per weight. The kernel this one replaced
    issued 7.5 at its rule's launch. And none of those launches spills."""
    results = [r for r in compiled if r["kernel"] == "w4_gemv_kernel" and r["arch"] == 90]
    assert len(results) > 10
    rule = next(r for r in results if r["case"].startswith("w4_gemv 8B gate_up (128, 128, 2, 4)"))
    sym = next(r for r in results if r["case"].startswith("w4_gemv symmetric 8B gate_up (128, 128, 2, 4)"))
    assert rule["loop_ops"]["per_weight"] < 5.3 and sym["loop_ops"]["per_weight"] < 5.0, (rule, sym)
    assert rule["loop_ops"]["FFMA"] >= 2 * 128 and rule["loop_ops"]["LOP3.LUT"] < 1.2 * 128  # per weight: 2 and 1
    assert all(r["loop_ops"]["per_weight"] < 7.5 for r in results), [(r["case"], r["loop_ops"]["per_weight"])
                                                                     for r in results]


def test_the_tiled_int4_kernel_keeps_its_code_planes_in_registers(compiled):
    """At 16-64 rows in groups of >= 128 the W4A16 products run over code planes made from bits
    (triton_kernels.w4_planes_kernel), each the first operand of its product, which the tensor cores take from
    registers: no code goes through shared memory one 16-bit store at a time (x's tile may, the second operand) and
    none through an int-to-float conversion, where the tile of whole weights did both per weight (8.6 instructions per weight at 16 rows on
    Llama-3-8B's gate_up, 9.1 at 64; bench/sass.py --only prior)."""
    rows = {r["case"]: r for r in compiled if r["kernel"] == "w4_planes_kernel" and r["arch"] == 90}
    bars = {(16, " symmetric"): 4.6, (16, ""): 5.3, (32, " symmetric"): 5.1, (32, ""): 6.4, (64, " symmetric"): 7.0}
    for (n, sym), bar in bars.items():  # per weight (at 64 rows with zeros the whole weights stay: w4_planes_tile)
        r = rows[f"w4_matmul{sym} 8B gate_up {n} rows bfloat16"]
        ops, x_share = r["loop_ops"], n * 128 / (32 * r["num_warps"])  # a thread's part of x's (n, 128) tile
        # x's tile is the one staged 16 bits at a time (the second operand), not the codes
        assert ops.get("STS.U16", 0) <= x_share + 2 and "I2FP.F32.S32" not in ops and ops["per_weight"] < bar, \
            (n, sym, ops)


def test_compile_only_refuses_under_the_interpreter():
    """bench/sass.py run where TRITON_INTERPRET=1 (conftest's, for the interpreter tests) refuses in so many words
    rather than interpret what it should compile."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "sass.py"), "--only", "glue"], capture_output=True,
                       text=True, timeout=300, cwd=ROOT)
    refusal = "RuntimeError: compile_only needs Triton's compiler: unset TRITON_INTERPRET"
    assert r.returncode != 0 and refusal in r.stderr, r.stderr[-3000:]


def test_the_gpu_checks_parts_are_named_and_ordered():
    """bench/gpu.py --only (a lease's plan): an unknown part is refused in one line, naming the parts in a lease's
    order (headline first), before anything runs, even where no GPU is; --help describes every part."""

    def gpu_py(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), *args], capture_output=True,
                              text=True, timeout=120, cwd=ROOT)

    r = gpu_py("--only", "engine,nope, gmev")
    assert r.returncode == 2 and "unknown part(s) nope, gmev; parts: " in r.stderr and "Traceback" not in r.stderr, \
        r.stderr
    parts = r.stderr.strip().splitlines()[-1].split("; parts: ")[1].split(", ")
    assert parts[:2] == ["headline", "bf16"] and len(parts) == len(set(parts)) > 2, parts
    r = gpu_py("--only", ",")
    assert r.returncode == 2 and "unknown part(s) (none)" in r.stderr and "Traceback" not in r.stderr, r.stderr
    described = " ".join(gpu_py("--help").stdout.split())  # argparse wraps the help's lines
    assert all(f" {p}: " in described for p in parts), described


LISTING = """.L_x_0:
        /*0000*/                   FFMA R0, R1, R2, R0 ;
        /*0010*/                   IADD3 R1, R1, 0x1, RZ ;
        /*0020*/               @P0 BRA `(.L_x_0) ;
        /*0030*/                   EXIT ;
"""


def test_the_tools_readings_are_kept_by_the_cubins_digest_and_a_damaged_record_is_read_again(tmp_path, monkeypatch):
    """bench/sass.py keeps what cuobjdump and nvdisasm read from a cubin under the quantserve cache: the same cubin
    is not read twice, another one is, and a damaged record is read again from the tools and replaced."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("sass_under_test", ROOT / "bench" / "sass.py")
    sass = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, sass)  # where its dataclasses look themselves up
    spec.loader.exec_module(sass)
    for tool in ("cuobjdump", "nvdisasm"):
        (tmp_path / tool).write_text(tool)
    monkeypatch.setattr(sass, "_tool", lambda name: str(tmp_path / name))
    monkeypatch.setenv("QUANTSERVE_CACHE", str(tmp_path / "cache"))
    ran = []

    def tool_run(cmd, **kw):
        ran.append(Path(cmd[0]).name)
        out = "REG:40 STACK:0 SHARED:0 LOCAL:8" if ran[-1] == "cuobjdump" else LISTING
        return subprocess.CompletedProcess(cmd, 0, out, "")

    monkeypatch.setattr(sass.subprocess, "run", tool_run)
    want = {"registers": 40, "stack": 0, "local": 8, "loop": {"FFMA": 1, "IADD3": 1, "BRA": 1}}
    assert sass._read_cubin(b"cubin one", "k") == want and ran == ["cuobjdump", "nvdisasm"]
    assert sass._read_cubin(b"cubin one", "k") == want and len(ran) == 2  # kept
    (kept,) = (tmp_path / "cache" / "sass").glob("*.json")
    kept.write_text("{damaged")
    assert sass._read_cubin(b"cubin one", "k") == want and len(ran) == 4  # read again
    assert json.loads(kept.read_text()) == want
    assert sass._read_cubin(b"cubin two", "k") == want and len(ran) == 6  # another cubin
