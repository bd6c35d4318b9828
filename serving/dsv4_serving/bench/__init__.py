"""``dsv4 bench``: a load client in the manner of aisbench and ``vllm bench serve``."""
