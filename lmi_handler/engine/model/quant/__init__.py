"""Quantized linears: pre-quantized checkpoints (GPTQ, AWQ, compressed-tensors) read once at load into the C++
kernel's code panels (weight.py, kernels/linear_quant.h), never dequantized as a whole model."""
