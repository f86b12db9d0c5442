"""The model runtime: loaders, models, tokenizer, generation."""
