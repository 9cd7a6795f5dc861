"""Flax ports of llama-like decoder LLMs that carry a kvjax compressed cache."""
