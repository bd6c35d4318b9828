"""DeepSeek's chat format (V3.2 and V4) and the parser of its completions: pure Python, no torch.

The engine's HTTP server and the gateway both import it: the gateway hashes the same rendered
prompt the engine encodes. Nothing here is wired into a server yet (see docs/agent-api.md).
"""
