"""Compiling fa3's kernels: the DSL import and target, the symbolic signatures, the compile
caches (in memory and on disk) and each family's builders and keys."""
