"""The bottom layer: config, seeding, launch, io, plots. Every package may import it; it imports
none of them."""

__version__ = "0.1.0"
