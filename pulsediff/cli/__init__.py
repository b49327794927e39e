"""The `pulsediff` command line: thin commands over the library.

Commands check their flags, call `pulsediff`'s API and render through
`output.Output`. Heavy modules (torch, numba, zstd) are imported inside the
command functions, so `pulsediff --help` answers at once.
"""
