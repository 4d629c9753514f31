"""What a served quantized model runs: the quantized Linear families (one module each, with its reference path),
their kernels (quant.runtime.kernels), kernel choice and timing, and loading an artifact into modules."""
