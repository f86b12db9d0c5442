"""`infer serve`: the OpenAI and ollama HTTP APIs over the same library calls as `infer run`."""
