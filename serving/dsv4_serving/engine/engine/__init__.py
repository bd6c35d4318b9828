"""The front end (``AsyncLLM``) and the engine core process, and the messages between them."""
