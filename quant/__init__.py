"""Quantization: the formats (formats/) and the offline algorithms over a model
(recipes' application, GPTQ, Block-AP, scale tuning)."""
