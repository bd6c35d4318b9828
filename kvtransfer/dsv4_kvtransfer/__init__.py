"""KV transfer between prefill and decode pods: protocol, transports and the sidecar.

Never imports the engine.
"""
