"""pulsediff's version: one place, imported by the package, the CLI and the patches it writes."""

__version__ = "0.1.0"
