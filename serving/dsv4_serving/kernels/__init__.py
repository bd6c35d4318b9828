"""CPU kernels built on the machine that runs them (``torch.utils.cpp_extension``), each with a
pure-torch fallback used where no compiler is available (a slim image) or the build fails."""
