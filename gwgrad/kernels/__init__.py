"""CuTe DSL kernels. The kernel modules pull in the CuTe DSL, so the core imports them lazily,
only when a GPU spec needs one; ``tiling`` (which tilings each kernel runs) imports nothing."""
