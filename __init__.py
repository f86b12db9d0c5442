"""infer: run large language models locally, CPU first."""

__version__ = "0.1.0"
