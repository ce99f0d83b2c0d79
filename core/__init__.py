"""The bottom layer: config, runtime, io, plots. Every package may import it; it imports
none of them."""

__version__ = "0.1.0"
