"""Evaluation of codecs and of models whose KV cache is compressed.

- :mod:`kvjax.eval.ppl`: perplexity over fixed corpus windows through the cache path that
  decoding uses.
- :mod:`kvjax.eval.needle`: needle-in-a-haystack retrieval with a generating model.
- :mod:`kvjax.eval.synthetic`: model-free probes on Gaussian keys (reconstruction,
  inner products, a synthetic needle).
- :mod:`kvjax.eval.memory`: cache bytes per token and at long contexts, measured from
  encoded arrays.

The model is an argument, never an import (DESIGN.md §2).
"""

from kvjax.eval.ppl import PerplexityResult, perplexity

__all__ = ["PerplexityResult", "perplexity"]
