"""Tests of the engine in process: scheduling, sampling, structured output, models, kernels, quantization, LoRA."""
