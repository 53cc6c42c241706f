"""The package version, read by the build (pyproject.toml) and by ``lorabus --version``."""

__version__ = "0.3.0"
