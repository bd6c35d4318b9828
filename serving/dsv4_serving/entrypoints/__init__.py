"""Entry points of the engine: the OpenAI-compatible HTTP server and ``dsv4 engine``."""
