"""The engine's KV event publisher (ZMQ PUB + replay ROUTER, vLLM's wire format)."""
