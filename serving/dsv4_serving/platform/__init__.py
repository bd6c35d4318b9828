"""Device platforms (cpu, cuda, npu) and the attention-backend choice."""

from dsv4_serving.platform.backend import AttentionBackendChoice, select_attention_backend
from dsv4_serving.platform.device import Platform, PlatformError, detect_platform, get_platform

__all__ = [
    "AttentionBackendChoice",
    "Platform",
    "PlatformError",
    "detect_platform",
    "get_platform",
    "select_attention_backend",
]
