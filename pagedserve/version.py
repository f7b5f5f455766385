"""The package version (one place: the package, the server's /version and its OpenAPI schema read it)."""

__version__ = "0.1.0"
