"""Quantized weights that stay quantized: the scheme a checkpoint declares and the methods that
create, hold and compute with its weights (``docs/quantization.md``)."""
