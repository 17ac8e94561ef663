"""Quantized weights: which form `quantization` gives a model (`quantization`), int8 linears with int8
activations (`quantize`), weight-only int8 or fp8 through torchao (`weight_only`), the fused int8 gate and
up projections (`fusion`)."""
