"""What a quantization scheme is to the pipeline, the loader, the accounting and the server.

A scheme (``quant/build/schemes/<scheme>.py``, registered by name in ``quant.build.schemes``) states:
- its options: the ``BuildConfig`` fields that apply to it, and those it fixes from the model (``resolve``:
  w4a16's group size);
- how it quantizes a decoder layer (``layer_quantizer``: an object with ``quantize_layer(li, layer)`` and a
  ``report``) and the output head (``quantize_head``), on the meta skeleton the build streams;
- its runtime modules (``runtime``: ``quant.runtime.linear.QuantizedLinear`` subclasses, which carry the spec
  round-trip, the after-load hook and the fusing);
- what it writes into the artifact (``quantization_config``, ``extra_files``, the manifest's ``parameters``);
- its predicted bytes: the weights (``linear_bytes``, ``head_bytes``) as the artifacts lay them out, and what a
  build holds for it (``calib_activation_bytes``, ``solver_bytes``), used by ``quant.shape.memory``.
Anchors: gpt-fast's per-scheme handlers, vLLM's ``QuantizeMethodBase``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from torch import nn

from quant.errors import ConfigError
from quant.format import artifact
from quant.runtime.linear import QuantizedLinear

if TYPE_CHECKING:
    import torch

    from quant.build.config import BuildConfig
    from quant.shape.model import ModelShape


class LayerQuantizer(Protocol):
    report: dict | None

    def quantize_layer(self, li: int, layer: nn.Module) -> None:
        """Replace `layer`'s Linears by runtime modules; the layer is materialised, in the compute dtype."""


class Scheme:
    name: str
    runtime: tuple[type[QuantizedLinear], ...]
    needs_calibration: bool = False
    no_head_because: str | None = None  # why --include-lm-head is refused (None: it is supported)
    options: tuple[str, ...] = ()  # the BuildConfig fields this scheme reads (others do not change its output)
    summary: str = ""

    @property
    def supports_lm_head(self) -> bool:
        return self.no_head_because is None

    def check(self, cfg: BuildConfig) -> None:
        """Refuse, in one line, options this scheme cannot honour (before any work)."""
        if cfg.include_lm_head and not self.supports_lm_head:
            raise ConfigError(f"--include-lm-head is not available for {self.name}: {self.no_head_because}")

    def resolve(self, cfg: BuildConfig, model: nn.Module) -> dict:
        """Options fixed from the model before any work (refusing what the scheme cannot do, in one line)."""
        return {}

    def layer_quantizer(self, cfg: BuildConfig, model: nn.Module, calib_ids: torch.Tensor | None,
                        resolved: dict) -> LayerQuantizer:
        raise NotImplementedError

    def quantize_head(self, cfg: BuildConfig, head: nn.Linear) -> QuantizedLinear:
        raise NotImplementedError

    def parameters(self, cfg: BuildConfig, resolved: dict, report: dict | None) -> dict:
        """This scheme's entries of the manifest's ``parameters``."""
        return {}

    def quantization_config(self, cfg: BuildConfig, resolved: dict, modules: dict[str, dict]) -> dict:
        """config.json's ``quantization_config``: ours lists every quantized module's spec."""
        return {"quant_method": artifact.QUANT_METHOD, "format_version": artifact.format_version(modules),
                "scheme": self.name, "modules": modules}

    def extra_files(self, cfg: BuildConfig, resolved: dict) -> dict[str, str]:
        """Other files the artifact carries for loaders of this format (name -> text)."""
        return {}

    def linear_bytes(self, n: int, k: int, group_size: int) -> tuple[int, int]:
        """(quantized weight bytes, parameter bytes) of one (n x k) Linear as stored."""
        raise NotImplementedError

    def served_linear_bytes(self, n: int, k: int, group_size: int, float_bytes: int) -> tuple[int, int]:
        """(weight bytes, parameter bytes) one (n x k) Linear holds when served with `float_bytes` activations:
        its runtime layout (``QuantizedLinear.prepare``), which is the stored one unless the scheme repacks."""
        return self.linear_bytes(n, k, group_size)

    def head_bytes(self, vocab: int, hidden: int) -> tuple[int, int]:
        return self.linear_bytes(vocab, hidden, 0)

    def calib_activation_bytes(self, shape: ModelShape, tokens: int) -> int:
        """What the build keeps of a layer's inner activations for `tokens` calibration tokens (fp32)."""
        return 0

    def solver_bytes(self, n: int, k: int) -> int:
        """The working set of quantizing the largest (n x k) Linear of a layer."""
        return 3 * n * k * 4
