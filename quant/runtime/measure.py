"""Memory measured, not predicted: a loaded model's weights by tensor class, the process's resident memory, a
device's free memory, and a tracker of the tensor memory a block of code allocates (which the predictions of
``quant.shape.memory`` are held to)."""

from __future__ import annotations

import os

import torch
from torch import nn

from quant.runtime.linear import QuantizedLinear
from quant.shape.memory import dtype_bytes


def _unique_tensors(model: nn.Module):
    """(name, tensor, owning module) for every parameter and persistent buffer, shared storage once."""
    seen: set[int] = set()
    for mod_name, mod in model.named_modules():
        tensors = list(mod.named_parameters(recurse=False)) + [
            (n, b) for n, b in mod.named_buffers(recurse=False) if n not in mod._non_persistent_buffers_set
        ]
        for n, t in tensors:
            # Shared storage is one tensor; a meta tensor (a streamed build's released part) has none,
            # and ties there are the same Parameter object.
            if t is None:
                continue
            key = id(t) if t.is_meta else t.data_ptr()
            if key in seen and t.numel():
                continue
            seen.add(key)
            yield (f"{mod_name}.{n}" if mod_name else n), t, mod


def weight_report(model: nn.Module) -> dict:
    """Bytes per class: quantized integer weights, quantization parameters, float tensors."""
    classes = {"quantized_weights": 0, "quant_params": 0, "float_weights": 0}
    for name, t, mod in _unique_tensors(model):
        leaf = name.rsplit(".", 1)[-1]
        nbytes = t.numel() * t.element_size()
        # Tensor classes of the weight memory (W): quantized modules name their tensors; anything else is float.
        quantized_module = isinstance(mod, QuantizedLinear)
        if quantized_module and leaf in mod.DATA_TENSORS and not t.is_floating_point():
            classes["quantized_weights"] += nbytes
        elif quantized_module and leaf in mod.PARAM_TENSORS:
            classes["quant_params"] += nbytes
        else:
            classes["float_weights"] += nbytes
    classes["total"] = sum(classes.values())
    return classes


def float_model_bytes(model: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Weight bytes of an unquantized model, optionally as if stored in `dtype`."""
    total = 0
    for _, t, _ in _unique_tensors(model):
        size = dtype_bytes(dtype) if (dtype is not None and t.is_floating_point()) else t.element_size()
        total += t.numel() * size
    return total


def current_rss_bytes() -> int:
    """This process's resident memory now (Linux /proc; 0 where that is not available)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def available_bytes(device: torch.device) -> int:
    """Memory a build may use on `device`: free CUDA memory, or the machine's available RAM."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class MemoryTracker:
    """Live tensor bytes during a region, op by op (the allocator's view, on any device).

    A TorchDispatchMode records every storage an op creates and drops it once its last reference is
    gone; `peak` is the most ever alive at once, counting only storages created inside the region.
    """

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self

        class _Mode(TorchDispatchMode):
            @classmethod
            def _should_skip_dynamo(cls) -> bool:
                # Otherwise the mode's handler is wrapped to keep torch.compile out of it, and that wrapper's
                # first call imports torch dynamo: ~120 MiB resident in a server that never compiles (it
                # measures its projections' transients with this tracker).
                return False

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                tracker._observe(out)
                return out

        self._mode = _Mode()
        self.live: dict[int, tuple] = {}
        self.current = 0
        self.peak = 0

    def _observe(self, out) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._pytree import tree_flatten

        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.current -= self.live.pop(key)[1]
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                st = t.untyped_storage()
                if st.nbytes() and st.data_ptr() not in self.live:
                    self.live[st.data_ptr()] = (StorageWeakRef(st), st.nbytes())
                    self.current += st.nbytes()
        self.peak = max(self.peak, self.current)

    def exclude(self, t: torch.Tensor) -> "MemoryTracker":
        """Leave out a storage that existed before the region (ops that return views of it create nothing)."""
        from torch.multiprocessing.reductions import StorageWeakRef

        st = t.untyped_storage()
        self.live[st.data_ptr()] = (StorageWeakRef(st), 0)
        return self

    def __enter__(self) -> "MemoryTracker":
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
