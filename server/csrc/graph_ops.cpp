// CPU step graphs (server/cpu_graphs.py): the ops of a decode step's forward as recorded once from Python, replayed
// here as boxed dispatcher calls in that order, without the Python between them or the Python binding of each op
// (about 3 us a call of a batch-1 step's ~300 ops). The same ops on the same tensors: the replay computes what the
// recorded forward computed, bit for bit.
//
// A program is a list of instructions over registers (the step's input tensors first, then each instruction's
// tensor outputs, flattened) and constants (the weights, the KV pool, scalars): an instruction is an operator and
// its arguments in schema order (kwargs and defaults filled in by the recorder), each a constant, a register or a
// list of tensors (each a constant or a register), and the registers it frees when it is their last reader, so
// intermediates live no longer than they did in the eager forward. What changes from step to step reaches the ops
// as tensors (a chunk's first position too: prefill_attention_at).
//
// set_profile(true) times each instruction's call (take_profile gives calls and seconds per instruction, op_names
// their operators): where a replayed step goes, as bench/decode_step.py --replayed reports it.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/InferenceMode.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

namespace {

enum Kind : int64_t { kConst = 0, kReg = 1, kList = 2 };

struct Arg {
  int64_t kind, a, b;  // kConst: consts[a]; kReg: regs[a]; kList: the elements [a, a + b) of elems
  int list_type;       // kList: 0 Tensor[], 1 Tensor?[]
};

struct Instr {
  c10::OperatorHandle op;
  std::vector<Arg> args;
  std::vector<int64_t> outs;     // the register of each tensor output, flattened (-1: not read again)
  std::vector<int64_t> release;  // registers freed after it
};

struct Program : torch::CustomClassHolder {
  std::vector<c10::IValue> consts;
  std::vector<std::pair<int64_t, int64_t>> elems;  // list elements: (kConst | kReg | -1 for None, index)
  std::vector<Instr> code;
  int64_t inputs = 0, registers = 0;
  // With profiling on (set_profile), each instruction's calls and seconds since the last take_profile.
  bool profiling = false;
  std::vector<double> spent;
  std::vector<int64_t> calls;

  int64_t push(c10::IValue v) {
    consts.push_back(std::move(v));
    return static_cast<int64_t>(consts.size()) - 1;
  }
  int64_t const_tensor(at::Tensor t) { return push(std::move(t)); }
  int64_t const_int(int64_t v) { return push(v); }
  int64_t const_float(double v) { return push(v); }
  int64_t const_bool(bool v) { return push(v); }
  int64_t const_none() { return push(c10::IValue()); }
  int64_t const_str(std::string v) { return push(std::move(v)); }
  int64_t const_ints(std::vector<int64_t> v) { return push(std::move(v)); }
  int64_t const_floats(std::vector<double> v) { return push(std::move(v)); }
  int64_t const_dtype(const at::Tensor& like) { return push(like.scalar_type()); }
  int64_t const_device(std::string v) { return push(c10::Device(v)); }
  // A Python number where the schema takes a Tensor: the 0-dim "wrapped number" tensor Python's binding makes of it
  // (type promotion treats it as a scalar); kind 0 float, 1 int, 2 bool.
  int64_t const_number(double v, int64_t kind) {
    at::Tensor t = kind == 0 ? at::scalar_tensor(v, at::kDouble)
                 : kind == 1 ? at::scalar_tensor(static_cast<int64_t>(v), at::kLong)
                             : at::scalar_tensor(v != 0.0, at::kBool);
    t.unsafeGetTensorImpl()->set_wrapped_number(true);
    return push(std::move(t));
  }

  void set_registers(int64_t n_inputs, int64_t n_registers) {
    TORCH_CHECK(0 <= n_inputs && n_inputs <= n_registers, "bad register counts");
    inputs = n_inputs, registers = n_registers;
  }

  // One instruction: operator `name` (e.g. "aten::mul") of overload `overload` ("" for default); per schema argument
  // (kind, a, b): kConst (a: constant), kReg (a: register), kList (elements [a, a + b) of `elem_kinds` /
  // `elem_index`: kConst, kReg, or -1 for None); `outs`: the register of each tensor output, flattened.
  void add(const std::string& name, const std::string& overload, std::vector<int64_t> kinds, std::vector<int64_t> a,
           std::vector<int64_t> b, std::vector<int64_t> elem_kinds, std::vector<int64_t> elem_index,
           std::vector<int64_t> outs, std::vector<int64_t> release) {
    auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
    const auto& schema = op.schema().arguments();
    TORCH_CHECK(kinds.size() == schema.size() && a.size() == kinds.size() && b.size() == kinds.size(), name, ".",
                overload, ": ", kinds.size(), " arguments for a schema of ", schema.size());
    TORCH_CHECK(elem_kinds.size() == elem_index.size(), "list elements and their kinds differ in length");
    const int64_t base = static_cast<int64_t>(elems.size());
    for (size_t i = 0; i < elem_kinds.size(); ++i) {
      TORCH_CHECK(elem_kinds[i] == -1 || elem_kinds[i] == kConst || elem_kinds[i] == kReg, "bad list element kind");
      check_index(elem_kinds[i], elem_index[i]);
      elems.emplace_back(elem_kinds[i], elem_index[i]);
    }
    Instr ins{op, {}, std::move(outs), std::move(release)};
    for (size_t i = 0; i < kinds.size(); ++i) {
      Arg arg{kinds[i], a[i], b[i], 0};
      if (kinds[i] == kList) {
        TORCH_CHECK(a[i] >= 0 && b[i] >= 0 && a[i] + b[i] <= static_cast<int64_t>(elem_kinds.size()),
                    "list elements out of range");
        arg.a += base;
        const auto& type = schema[i].type();
        const auto* list = type->castRaw<c10::ListType>();
        TORCH_CHECK(list != nullptr, name, ": argument ", schema[i].name(), " is not a list");
        const auto& el = list->getElementType();
        if (el->kind() == c10::TypeKind::TensorType) {
          arg.list_type = 0;
        } else {
          const auto* opt = el->castRaw<c10::OptionalType>();
          TORCH_CHECK(opt != nullptr && opt->getElementType()->kind() == c10::TypeKind::TensorType, name,
                      ": argument ", schema[i].name(), " is not a list of tensors");
          arg.list_type = 1;
        }
      } else {
        TORCH_CHECK(kinds[i] == kConst || kinds[i] == kReg, "bad argument kind ", kinds[i]);
        check_index(kinds[i], a[i]);
      }
      ins.args.push_back(arg);
    }
    for (int64_t r : ins.outs) TORCH_CHECK(r >= -1 && r < registers, "output register out of range");
    for (int64_t r : ins.release) TORCH_CHECK(r >= 0 && r < registers, "released register out of range");
    code.push_back(std::move(ins));
  }

  // Replays the program on `in` (one tensor per input register); the tensors in registers `out`.
  std::vector<at::Tensor> run(std::vector<at::Tensor> in, std::vector<int64_t> out) {
    TORCH_CHECK(static_cast<int64_t>(in.size()) == inputs, "the program takes ", inputs, " inputs, got ", in.size());
    for (int64_t r : out) TORCH_CHECK(r >= 0 && r < registers, "output register out of range");
    c10::InferenceMode guard;
    std::vector<c10::IValue> regs(registers);
    for (int64_t i = 0; i < inputs; ++i) regs[i] = std::move(in[i]);
    torch::jit::Stack stack;
    stack.reserve(32);
    for (const Instr& ins : code) {
      stack.clear();
      for (const Arg& arg : ins.args) {
        if (arg.kind == kConst) {
          stack.push_back(consts[arg.a]);
        } else if (arg.kind == kReg) {
          stack.push_back(regs[arg.a]);
        } else if (arg.list_type == 0) {
          c10::List<at::Tensor> list;
          list.reserve(arg.b);
          for (int64_t e = arg.a; e < arg.a + arg.b; ++e) list.push_back(element(e, regs).toTensor());
          stack.emplace_back(std::move(list));
        } else {
          c10::List<std::optional<at::Tensor>> list;
          list.reserve(arg.b);
          for (int64_t e = arg.a; e < arg.a + arg.b; ++e) {
            const c10::IValue& v = element(e, regs);
            list.push_back(v.isNone() ? std::optional<at::Tensor>() : std::optional<at::Tensor>(v.toTensor()));
          }
          stack.emplace_back(std::move(list));
        }
      }
      if (profiling) {
        const auto t0 = std::chrono::steady_clock::now();
        ins.op.callBoxed(stack);
        const size_t i = &ins - code.data();
        spent[i] += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        calls[i] += 1;
      } else {
        ins.op.callBoxed(stack);
      }
      size_t o = 0;
      for (c10::IValue& v : stack) {
        if (v.isTensor()) {
          TORCH_CHECK(o < ins.outs.size(), ins.op.schema().name(), " returned more tensors than recorded");
          if (ins.outs[o] >= 0) regs[ins.outs[o]] = std::move(v);
          ++o;
        } else if (v.isTensorList()) {
          for (const at::Tensor& t : v.toTensorList()) {
            TORCH_CHECK(o < ins.outs.size(), ins.op.schema().name(), " returned more tensors than recorded");
            if (ins.outs[o] >= 0) regs[ins.outs[o]] = t;
            ++o;
          }
        }
      }
      TORCH_CHECK(o == ins.outs.size(), ins.op.schema().name(), " returned ", o, " tensors, recorded ",
                  ins.outs.size());
      for (int64_t r : ins.release) regs[r] = c10::IValue();
    }
    std::vector<at::Tensor> result;
    result.reserve(out.size());
    for (int64_t r : out) {
      TORCH_CHECK(regs[r].isTensor(), "output register ", r, " holds no tensor");
      result.push_back(regs[r].toTensor());
    }
    return result;
  }

  int64_t size() const { return static_cast<int64_t>(code.size()); }

  // Between replays (the counters are not shared safely with a run in progress).
  void set_profile(bool on) {
    spent.assign(code.size(), 0.0);
    calls.assign(code.size(), 0);
    profiling = on;
  }
  // Each instruction's operator ("ns::name.overload"), in program order.
  std::vector<std::string> op_names() const {
    std::vector<std::string> out;
    for (const Instr& ins : code) {
      const auto& n = ins.op.schema().operator_name();
      out.push_back(n.overload_name.empty() ? n.name : n.name + "." + n.overload_name);
    }
    return out;
  }
  // (instructions, 2) float64: each instruction's calls and seconds since profiling was set or last taken.
  at::Tensor take_profile() {
    at::Tensor t = at::zeros({static_cast<int64_t>(code.size()), 2}, at::kDouble);
    auto a = t.accessor<double, 2>();
    for (size_t i = 0; i < spent.size(); ++i) a[i][0] = static_cast<double>(calls[i]), a[i][1] = spent[i];
    std::fill(spent.begin(), spent.end(), 0.0);
    std::fill(calls.begin(), calls.end(), 0);
    return t;
  }

 private:
  void check_index(int64_t kind, int64_t i) const {
    if (kind == kConst) TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(consts.size()), "constant out of range");
    if (kind == kReg) TORCH_CHECK(i >= 0 && i < registers, "register out of range");
  }
  const c10::IValue& element(int64_t e, const std::vector<c10::IValue>& regs) const {
    static const c10::IValue none;
    const auto& [kind, i] = elems[e];
    return kind == kConst ? consts[i] : kind == kReg ? regs[i] : none;
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(quantserve, m) {
  m.class_<Program>("StepProgram")
      .def(torch::init<>())
      .def("const_tensor", &Program::const_tensor)
      .def("const_int", &Program::const_int)
      .def("const_float", &Program::const_float)
      .def("const_bool", &Program::const_bool)
      .def("const_none", &Program::const_none)
      .def("const_str", &Program::const_str)
      .def("const_ints", &Program::const_ints)
      .def("const_floats", &Program::const_floats)
      .def("const_dtype", &Program::const_dtype)
      .def("const_device", &Program::const_device)
      .def("const_number", &Program::const_number)
      .def("set_registers", &Program::set_registers)
      .def("add", &Program::add)
      .def("run", &Program::run)
      .def("size", &Program::size)
      .def("set_profile", &Program::set_profile)
      .def("op_names", &Program::op_names)
      .def("take_profile", &Program::take_profile);
}
