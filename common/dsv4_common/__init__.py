"""What every dsv4 package shares and nothing else: the ``dsv4`` umbrella command, the process
helper, the OpenAI error body, named ports and config dataclasses turned into command lines.
Imports no other dsv4 package and no torch (checked by import-linter)."""
