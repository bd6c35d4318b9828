"""Attention backends: one module per device and attention family, each a subclass of
``base.AttentionBackend``; ``attention/selector.py`` imports them by name, only when tried."""
