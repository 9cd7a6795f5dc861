"""kvjax: KV-cache compression for LLMs in JAX."""

__version__ = "0.1.0"
