"""Command-line interface: a thin shell over `infer.runtime`."""
