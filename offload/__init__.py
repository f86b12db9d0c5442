"""Running models larger than memory: layers and experts read from disk as they run."""
