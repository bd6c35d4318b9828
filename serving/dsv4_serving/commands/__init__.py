"""The ``dsv4`` subcommands of the serving stack (``up``, ``trace``, ``explain-model``) and
the launcher they share with the dev cluster and the tests."""
