"""Multi-device parallelism: rank topology (pure Python), process groups and collectives."""
