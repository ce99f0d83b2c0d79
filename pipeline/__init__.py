"""semix pipeline spine: CLI, configs and presets, runtime. No ML math lives here."""

__version__ = "0.1.0"
