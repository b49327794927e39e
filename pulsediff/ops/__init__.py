"""The library's operations on checkpoints and patches: make, apply (into files; rebuild: one
tensor through a chain of patches), squash, stats, digests of checkpoints (inspect), and the
same on live tensors in memory (live). Most of the public API in pulsediff/__init__.py points here."""
