"""CPU step graphs: a step's forward recorded as the ops it dispatches, then replayed by one C++ call.

A batch-1 decode step of the default model dispatches ~160 ops (four projections and the attention per layer, the
norms and activation inside the projections' calls; the embedding, rotary tables and head); through Python each costs
~3 µs of binding and boxing on top of the Python between them, about a sixth of the step on a 2-core CPU
(bench/RESULTS.md#cpu-decode-step-benchdecode_steppy).
The CUDA graphs' idea on a CPU: a step of a given shape (its decode rows, its chunks' lengths, its sampled rows:
a decode step of n rows, a verification of k drafts, a short prompt's chunk) is recorded the second time such a step
runs (a ``TorchDispatchMode`` sees every op with its arguments while the step computes normally), recorded again
on the next, and from the fourth on replayed by ``torch.classes.quantserve.StepProgram`` (server/csrc/graph_ops.cpp):
the same ops, in the same order, on the same tensors, as boxed dispatcher calls from C++. So a replay computes
exactly what the eager forward computes, bit for bit (tests/test_cpu_graphs.py holds the two to each other).

What a step may vary is declared, not guessed: the step's tensors (token ids, positions, slots, sample rows), the
attention metadata's (block tables, key counts) and the tensors of its integers (a chunk's first position, a
``server.batch.StepInt``, which the fused ops take as a tensor) are the program's inputs; every other tensor an op reads is a
constant the program holds (the weights, the KV pool). The two recordings must agree op for op, argument for
argument, each constant the very same tensor: a tensor made afresh each step that is not an input, a Python value
that changed between the steps, or an op that reads a tensor's value into Python (``.item()``) means the forward
is not a fixed program, and that shape runs eagerly from then on (one log line). Intermediates are freed after
their last reader, as the eager forward frees them.

Steps over MAX_ROWS rows, prompt scoring and the unfused attention paths run eagerly; so does everything when the
C++ library is not loaded. ``EngineConfig(cpu_graphs=False)`` turns replay off.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections import OrderedDict

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from server.batch import StepInputs, StepInt

log = logging.getLogger("quantserve.engine")

MAX_ROWS = 64  # steps of at most this many rows are recorded (a program per shape, see CpuGraphs.key)
MAX_PROGRAMS = 64  # shapes kept (seen, recorded once, programs, refused), the least recently run dropped first
# Steps of a shape that run eagerly before it is recorded: with many requests at once, verifications and prompt
# chunks make shapes that seldom come again, and a recording step runs slower than an eager one
SEEN_BEFORE_RECORDING = 1
RUNS_BEFORE_REPLAY = SEEN_BEFORE_RECORDING + 2  # (then two recordings)
CONST, REG, LIST = 0, 1, 2  # argument kinds, as server/csrc/graph_ops.cpp numbers them
_MEMORY_FORMATS = {torch.contiguous_format: 0, torch.preserve_format: 1, torch.channels_last: 2,
                   torch.channels_last_3d: 3}


class NotAProgram(Exception):
    """The forward is not a fixed sequence of ops on the declared inputs; the message says why."""


class _Eager(Exception):
    """The eager forward itself failed (its cause): raised as it is, replay left on."""


def step_tensors(step: StepInputs, meta) -> list[Tensor]:
    """The tensors a step declares (its own fields' and its attention metadata's), each once, in field order."""
    out: dict[int, Tensor] = {}

    def walk(v) -> None:
        if isinstance(v, Tensor):
            out.setdefault(id(v), v)
        elif isinstance(v, StepInt):
            out.setdefault(id(v.tensor), v.tensor)
        elif isinstance(v, (list, tuple)):
            if v and isinstance(v[0], (int, float, str)):  # block ids, positions: no tensor in them
                return
            for x in v:
                walk(x)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            for f in dataclasses.fields(v):
                walk(getattr(v, f.name))

    walk(step)
    walk(meta)
    return list(out.values())


class _Recorder(TorchDispatchMode):
    """Every op the forward dispatches, its arguments in schema order as (kind, value): ("in", i) an input, ("reg",
    r) an earlier op's output, ("const", tensor), ("list", [...]) a list of tensors, ("val", v) anything else."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # else the mode's dispatch is wrapped to disable dynamo, which imports it (~50 MiB, unused here)

    def __init__(self, inputs: list[Tensor]):
        super().__init__()
        # id(tensor) -> (its reference, a weak reference to it): a tensor freed during the step holds nothing alive
        # (the recording step's memory is the eager step's), and an id reused after it is not taken for it
        self.where: dict[int, tuple[tuple[str, int], weakref.ref]] = {}
        for i, t in enumerate(inputs):
            self.where[id(t)] = (("in", i), weakref.ref(t))
        self.ops: list[tuple] = []  # (op, args, output registers)
        self.registers = 0
        self.result = -1  # the register of the forward's result (record sets it)

    def ref(self, v):
        if isinstance(v, Tensor):
            seen = self.where.get(id(v))
            return seen[0] if seen is not None and seen[1]() is v else ("const", v)
        if isinstance(v, (list, tuple)) and v and any(isinstance(x, Tensor) for x in v):
            return ("list", [None if x is None else self.ref(x) for x in v])
        return ("val", v)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema
        full = []
        for i, a in enumerate(schema.arguments):
            if i < len(args) and not a.kwarg_only:
                full.append(args[i])
            elif a.name in kwargs:
                full.append(kwargs[a.name])
            elif a.has_default_value():
                full.append(a.default_value)
            else:
                raise NotAProgram(f"{func}: argument {a.name} not given")
        refs = [self.ref(v) for v in full]
        out = func(*args, **kwargs)
        tensors = []
        for v in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(v, Tensor):
                tensors.append(v)
            elif isinstance(v, (tuple, list)) and all(isinstance(x, Tensor) for x in v):
                tensors.extend(v)
            elif v is not None:
                raise NotAProgram(f"{func} returns a value the forward reads in Python")
        regs = []
        for t in tensors:
            self.where[id(t)] = (("reg", self.registers), weakref.ref(t))
            regs.append(self.registers)
            self.registers += 1
        self.ops.append((func, refs, regs))
        return out


def record(forward, inputs: list[Tensor]) -> tuple[Tensor, _Recorder]:
    """forward() run once with its ops recorded; its result and the recording."""
    rec = _Recorder(inputs)
    with rec:
        out = forward()
    ref = rec.ref(out) if isinstance(out, Tensor) else ("val",)
    if ref[0] != "reg":
        raise NotAProgram("the forward's result is not an op's output")
    rec.result = ref[1]
    rec.where.clear()  # (the recording keeps its ops and their constants, nothing of the step)
    return out, rec


def _same(a, b) -> bool:
    if a[0] != b[0]:
        return False
    if a[0] == "const":
        return a[1] is b[1]
    if a[0] == "list":
        return len(a[1]) == len(b[1]) and all(
            (x is None and y is None) or (x is not None and y is not None and _same(x, y)) for x, y in zip(a[1], b[1]))
    if a[0] == "val":
        return type(a[1]) is type(b[1]) and a[1] == b[1]
    return a[1] == b[1]


def agree(a: _Recorder, b: _Recorder) -> None:
    """Raises NotAProgram where two recordings of a forward differ."""
    if len(a.ops) != len(b.ops):
        raise NotAProgram(f"the steps dispatched {len(a.ops)} and {len(b.ops)} ops")
    for i, ((fa, ra, oa), (fb, rb, ob)) in enumerate(zip(a.ops, b.ops)):
        if fa is not fb or len(oa) != len(ob):
            raise NotAProgram(f"op {i}: {fa} then {fb}")
        for j, (x, y) in enumerate(zip(ra, rb)):
            if not _same(x, y):
                what = "a tensor made afresh each step" if x[0] == "const" else "a value that changed"
                raise NotAProgram(f"op {i} ({fa}), argument {fa._schema.arguments[j].name}: {what}")
    if a.result != b.result:
        raise NotAProgram("the result came from another op")


def _tensor_typed(t) -> bool:
    """Whether a schema argument's type is Tensor or Tensor?."""
    if isinstance(t, torch.OptionalType):
        t = t.getElementType()
    return isinstance(t, torch.TensorType)


def build(rec: _Recorder, n_inputs: int):
    """The C++ program of a recording: inputs are registers 0..n_inputs-1, op outputs follow."""
    prog = torch.classes.quantserve.StepProgram()
    reg = lambda r: n_inputs + r  # noqa: E731
    last: dict[int, int] = {}  # register -> the last op reading it
    for i, (_, refs, _) in enumerate(rec.ops):
        for r in refs:
            for x in (r[1] if r[0] == "list" else [r]):
                if x is not None and x[0] in ("in", "reg"):
                    last[reg(x[1]) if x[0] == "reg" else x[1]] = i
    keep = reg(rec.result)
    frees: dict[int, list[int]] = {}
    for r, i in last.items():
        if r != keep:
            frees.setdefault(i, []).append(r)
    prog.set_registers(n_inputs, n_inputs + rec.registers)
    consts: dict[int, int] = {}

    def const(v) -> int:
        if isinstance(v, Tensor):
            if id(v) not in consts:
                consts[id(v)] = prog.const_tensor(v)
            return consts[id(v)]
        if v is None:
            return prog.const_none()
        if isinstance(v, bool):
            return prog.const_bool(v)
        if isinstance(v, int):
            return prog.const_int(v)
        if isinstance(v, float):
            return prog.const_float(v)
        if isinstance(v, str):
            return prog.const_str(v)
        if isinstance(v, torch.dtype):
            return prog.const_dtype(torch.empty(0, dtype=v))
        if isinstance(v, torch.device):
            return prog.const_device(str(v))
        if isinstance(v, torch.memory_format):
            return prog.const_int(_MEMORY_FORMATS[v])
        if v is torch.strided:
            return prog.const_int(0)
        if isinstance(v, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            return prog.const_ints(list(v))
        if isinstance(v, (list, tuple)) and all(isinstance(x, float) for x in v):
            return prog.const_floats(list(v))
        raise NotAProgram(f"an argument of type {type(v).__name__} the replay cannot pass")

    def scalar(r, tensor_typed: bool = False) -> tuple[int, int]:  # (kind, index) of a non-list argument
        if r[0] == "in":
            return REG, r[1]
        if r[0] == "reg":
            return REG, reg(r[1])
        v = r[1]
        if tensor_typed and isinstance(v, (bool, int, float)):  # a Python number passed for a Tensor
            if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 2**53:
                raise NotAProgram("an integer too large to pass as a number")
            return CONST, prog.const_number(float(v), 2 if isinstance(v, bool) else 1 if isinstance(v, int) else 0)
        return CONST, const(v)

    for i, (func, refs, outs) in enumerate(rec.ops):
        kinds, a, b, ek, ei = [], [], [], [], []
        for r, arg in zip(refs, func._schema.arguments):
            if r[0] == "list":
                kinds.append(LIST), a.append(len(ek)), b.append(len(r[1]))
                for x in r[1]:
                    k, j = (-1, 0) if x is None else scalar(x)
                    ek.append(k), ei.append(j)
            else:
                k, j = scalar(r, _tensor_typed(arg.type))
                kinds.append(k), a.append(j), b.append(0)
        name, overload = func._schema.name, func._schema.overload_name
        prog.add(name, overload, kinds, a, b, ek, ei, [reg(o) for o in outs], sorted(frees.get(i, [])))
    return prog, keep


class CpuGraphs:
    """Per step shape (:meth:`key`): the steps seen so far (an int), a first recording, the C++ program, or None
    (runs eagerly); at most :data:`MAX_PROGRAMS` shapes, the least recently run dropped."""

    def __init__(self, model, backend):
        self.model, self.backend = model, backend
        self.programs: OrderedDict[tuple, object] = OrderedDict()
        self.replays = 0
        self.broken: str | None = None  # why replay is off, after a failure of its own
        self.profiling = False

    def key(self, step: StepInputs, meta) -> tuple | None:
        """What fixes a step's sequence of ops: its decode rows, its chunks' lengths and its sampled rows; None where
        it runs eagerly (prompt scoring, more than MAX_ROWS rows, attention paths that are not a fixed program:
        ``AttentionBackend.programmable``)."""
        if (step.score_index is not None or step.input_ids.numel() > MAX_ROWS
                or not self.backend.programmable(meta)):
            return None
        return len(step.decode), tuple(c for _, c, _, _ in step.chunks), step.sample_index.numel()

    def forward(self, step: StepInputs, meta) -> Tensor:
        """The step's logits: replayed, recorded, or eager (see the module's doc). A failure of the recording's or
        the replay's own machinery turns replay off for good, in one log line, and the step runs eagerly."""
        if self.broken is None:
            try:
                return self._forward(step, meta)
            except _Eager as e:  # the eager forward's own failure: not ours to hide
                raise e.__cause__ from None
            except Exception as e:  # noqa: BLE001
                self.broken = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                log.warning("cpu graphs off (%s); steps run eagerly", self.broken)
        return self.model.forward(step, self.backend, meta)

    def _forward(self, step: StepInputs, meta) -> Tensor:
        key = self.key(step, meta)

        def eager():
            try:
                return self.model.forward(step, self.backend, meta)
            except NotAProgram:
                raise
            except Exception as e:
                raise _Eager() from e

        if key is None:
            return eager()
        entry = self.programs.get(key, 0)
        if entry is None:
            return eager()
        if isinstance(entry, int) and entry < SEEN_BEFORE_RECORDING:  # a shape that may not come again: not yet
            self._keep(key, entry + 1)
            return eager()
        self.programs.move_to_end(key)
        inputs = step_tensors(step, meta)
        if isinstance(entry, tuple) and len(entry) == 3:  # (program, input count, result register)
            prog, count, out = entry
            if len(inputs) == count:
                self.replays += 1
                return prog.run(inputs, [out])[0]
            return self._refuse(key, f"declared {len(inputs)} tensors, recorded with {count}", eager())
        try:
            logits, rec = record(eager, inputs)
        except NotAProgram as e:  # raised inside the forward: run it again, unrecorded (it rewrites the same KV)
            return self._refuse(key, e, eager())
        try:
            if isinstance(entry, int):
                self._keep(key, (rec, len(inputs)))
            else:
                first, count = entry
                if count != len(inputs):
                    raise NotAProgram(f"the steps declared {count} and {len(inputs)} tensors")
                agree(first, rec)
                prog, out = build(rec, len(inputs))
                if self.profiling:
                    prog.set_profile(True)
                self._keep(key, (prog, len(inputs), out))
        except NotAProgram as e:
            return self._refuse(key, e, logits)
        return logits

    def set_profile(self, on: bool) -> None:
        """Whether replays time each op they call (:meth:`take_profile`; off, a replay checks one flag an op), for
        the programs held and those built later. Called between steps, as :meth:`take_profile` is."""
        self.profiling = on
        for prog in self._built():
            prog.set_profile(on)

    def take_profile(self) -> dict[str, tuple[int, float]]:
        """Per operator, its calls and seconds in the steps replayed since profiling was set or last taken (a program
        dropped meanwhile takes its own with it)."""
        out: dict[str, tuple[int, float]] = {}
        for prog in self._built():
            for name, (n, sec) in zip(prog.op_names(), prog.take_profile().tolist()):
                calls, total = out.get(name, (0, 0.0))
                out[name] = (calls + int(n), total + sec)
        return out

    def _built(self) -> list:
        return [e[0] for e in self.programs.values() if isinstance(e, tuple) and len(e) == 3]

    def _keep(self, key: tuple, entry) -> None:
        self.programs[key] = entry
        self.programs.move_to_end(key)
        while len(self.programs) > MAX_PROGRAMS:
            self.programs.popitem(last=False)

    def _refuse(self, key: tuple, why, logits: Tensor) -> Tensor:
        self._keep(key, None)
        log.info("cpu graphs: steps of %d decode rows and chunks %s run eagerly (%s)", key[0], list(key[1]), why)
        return logits
