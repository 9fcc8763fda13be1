"""Llama-family causal LM: config, rope, layers, the model and its checkpoint loader."""
