"""gwgrad's version, in one place: the package, the wheel's metadata (pyproject.toml reads it) and
the kernel cache's keys take it from here."""

__version__ = "0.1.0"
