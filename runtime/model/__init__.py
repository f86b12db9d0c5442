"""The model: config, the nn.Modules of each family, tokenizer and chat template."""
