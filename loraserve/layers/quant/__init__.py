"""Weights kept in GGUF's block-quantized formats: layouts and the torch twin (formats), the CPU kernels
(kernel, over quant_kernel.c), and on-load int8 quantization of float checkpoints (formats.Q8_0 rows)."""
