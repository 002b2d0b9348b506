"""CuTe DSL kernels. Importing this package (or its modules) pulls in the CuTe DSL; the core
imports them lazily, only when a GPU spec needs one."""
