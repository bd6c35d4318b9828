"""Weight loading: safetensors (single or sharded), native or transformers names, fp8/fp4
dequantisation, and ``load_format=dummy`` random weights."""
