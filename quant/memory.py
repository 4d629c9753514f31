"""Memory figures: weight bytes by tensor class, and the KV cache per token.

This is the one place the project computes memory; issue #3 extends it with activation peaks and the
training classes.
"""

from __future__ import annotations

import torch
from torch import nn

# Tensor classes of the weight memory (W). Quantized modules name their tensors; anything else is float.
QUANT_DATA = {"weight", "qweight"}  # int tensors inside quantized modules
QUANT_PARAMS = {"weight_scale", "weight_zero_point", "input_scale", "smooth_scale", "qzeros", "scales", "g_idx"}


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _unique_tensors(model: nn.Module):
    """(name, tensor, owning module) for every parameter and persistent buffer, shared storage once."""
    seen: set[int] = set()
    for mod_name, mod in model.named_modules():
        tensors = list(mod.named_parameters(recurse=False)) + [
            (n, b) for n, b in mod.named_buffers(recurse=False) if n not in mod._non_persistent_buffers_set
        ]
        for n, t in tensors:
            if t is None or t.data_ptr() in seen and t.numel():
                continue
            seen.add(t.data_ptr())
            yield (f"{mod_name}.{n}" if mod_name else n), t, mod


def weight_report(model: nn.Module) -> dict:
    """Bytes per class: quantized integer weights, quantization parameters, float tensors."""
    classes = {"quantized_weights": 0, "quant_params": 0, "float_weights": 0}
    for name, t, mod in _unique_tensors(model):
        leaf = name.rsplit(".", 1)[-1]
        nbytes = t.numel() * t.element_size()
        quantized_module = hasattr(mod, "spec")
        if quantized_module and leaf in QUANT_DATA and not t.is_floating_point():
            classes["quantized_weights"] += nbytes
        elif quantized_module and leaf in QUANT_PARAMS:
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


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """2 (K and V) * layers * kv_heads * head_dim * bytes(dtype)."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv * head_dim * dtype_bytes(dtype)
