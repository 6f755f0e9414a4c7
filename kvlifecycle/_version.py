"""The package version, written here only: ``pyproject.toml`` reads it (``[tool.setuptools.dynamic]``), and
``kvlifecycle.__version__`` and the OpenTelemetry instrumentation scope import it."""

__version__ = "0.1.0"
