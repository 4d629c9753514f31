"""The offline build: calibration, smoothing, rotation, thresholds, GPTQ, LoRA merging, evaluation and the schemes
that combine them (quant.build.schemes); quant.build.pipeline streams a model through a scheme into an artifact."""
