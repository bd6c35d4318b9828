"""The serving stack: engine, gateway and the ``dsv4`` command line."""
