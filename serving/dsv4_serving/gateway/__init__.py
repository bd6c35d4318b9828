"""The gateway: OpenAI-compatible front, PD orchestration (vLLM's protocol), DPLB routing.

Never imports torch: it runs in the light control-plane image.
"""
