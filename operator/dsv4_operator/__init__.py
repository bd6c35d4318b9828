"""The DeepSeekV4Deployment operator (kopf). Never imports torch or the engine."""
