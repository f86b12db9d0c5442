"""Model files: readers of GGUF, safetensors and our checkpoint, and where their weights live."""
