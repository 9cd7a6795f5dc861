"""Evaluation of codecs and of models whose KV cache is compressed.

- :mod:`kvjax.eval.ppl`: perplexity over fixed corpus windows through the cache path that
  decoding uses.
- :mod:`kvjax.eval.needle`: needle-in-a-haystack retrieval with a generating model.
- :mod:`kvjax.eval.synthetic`: model-free probes on Gaussian keys (reconstruction,
  inner products, a synthetic needle).
- :mod:`kvjax.eval.memory`: cache bytes per token and at long contexts, read from the
  shapes of the arrays that :func:`kvjax.cache.init_cache` allocates; the table of model
  shapes.
- :mod:`kvjax.eval.corpus`: the offline corpora (Shakespeare, Austen, text files) and
  their tokenized windows.
- :mod:`kvjax.eval.sweep`: a resumable sweep of cache configurations on one model and
  corpus (the evaluator is passed in), its tables and Pareto plots, and the helpers the
  papers' protocol scripts share.
- :mod:`kvjax.eval.provenance`: the git commit, versions, device and command that every
  results file records.
- :mod:`kvjax.eval.rotation_probes`: the OCTOPUS paper's probes of the rotation codecs
  (self-score shrinkage, equal stored bits, bit splits, 3x3 rounding vs the full grid).
- :mod:`kvjax.eval.lattice_rates`: HyperQuant's lattice rate measurements (second
  moments, Rice rate and the cost of not stripping, realized vs target rate).
- :mod:`kvjax.eval.timing`: the benchmarks' timing of jitted functions (compile apart,
  the median of dependent loops).

The model is an argument, never an import.
"""

from kvjax.eval.ppl import PerplexityResult, perplexity

__all__ = ["PerplexityResult", "perplexity"]
