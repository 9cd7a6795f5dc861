"""Per-layer bit allocation under a global budget, from measured sensitivities.

Each (layer, K|V) of a model is a *unit* that can be stored with one of a few candidate
codecs (``int:2``, ``int:4``, ``int:8``). :class:`Sensitivity` holds what each choice
costs in quality when that unit alone takes it and every other unit the most precise
candidate: ``loss[layer, role, c]``, the increase of a measured metric (mean KL
divergence from the bf16 cache's next-token distribution on calibration text,
:func:`models.evaluate.layer_sensitivity`). :func:`allocate` picks a codec per unit
minimizing the summed losses (the units taken as independent, as KVTuner does) with the
mean bits per element over all units within a budget: a multiple-choice knapsack, solved
exactly by dynamic programming over bits in steps of 1/64. :func:`allocation_spec`
writes the choice in the cache-spec grammar (``k=int:4 v=int:2 layers[0,3]:k=int:8``).

Every (layer, K|V) holds the same number of elements, so the cache's bits per element
is the plain mean of the units' bits. Per kv head choices are not offered: a cache
stores the heads of a layer with one codec.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kvjax.checkpoint import CheckpointError, load_arrays, save_arrays
from kvjax.spec import parse_codec

ROLES = ("k", "v")
#: the checkpoint kind of saved sensitivities
KIND = "layer-sensitivity"
#: the grain of the budget's dynamic program, in bits
STEP = 1 / 64


@dataclasses.dataclass(frozen=True)
class Sensitivity:
    """``loss[layer, role, c]``: the metric's increase when only that unit takes candidate
    ``candidates[c]`` (K codec specs; V takes each one's value codec), at ``bits[role][c]``
    bits per element; ``metric`` names the metric, ``base`` is its value with every unit
    at the most precise candidate."""

    candidates: tuple[str, ...]
    bits: dict[str, tuple[float, ...]]
    loss: np.ndarray
    metric: str = "kl_mean"
    base: float = 0.0

    def __post_init__(self):
        loss = np.asarray(self.loss, np.float64)
        if loss.ndim != 3 or loss.shape[1:] != (2, len(self.candidates)):
            raise ValueError(f"loss must be [layers, 2, {len(self.candidates)}], got "
                             f"{loss.shape}")
        if not np.isfinite(loss).all():
            raise ValueError("sensitivities must be finite")
        object.__setattr__(self, "loss", loss)
        object.__setattr__(self, "candidates", tuple(self.candidates))
        object.__setattr__(self, "bits", {r: tuple(map(float, self.bits[r])) for r in ROLES})

    @property
    def num_layers(self) -> int:
        return int(self.loss.shape[0])

    def codec(self, role: str, c: int) -> str:
        """The spec that unit ``role`` stores with under candidate ``c``."""
        codec = parse_codec(self.candidates[c])
        return (codec if role == "k" else codec.value_codec()).spec

    def save(self, path: str | Path, *, metadata: dict | None = None,
             overwrite: bool = False) -> int:
        """Write to the directory ``path`` as a :mod:`kvjax.checkpoint` of kind
        :data:`KIND` (the losses as an array; candidates, bits, metric, base and
        ``metadata`` such as the model and corpus in its record); returns its bytes on
        disk. :meth:`load` reads it."""
        record = {**(metadata or {}), "candidates": list(self.candidates),
                  "bits": {r: list(b) for r, b in self.bits.items()},
                  "metric": self.metric, "base": self.base}
        return save_arrays(path, {"loss": self.loss}, record, kind=KIND, overwrite=overwrite)

    @classmethod
    def load(cls, path: str | Path) -> Sensitivity:
        """What :meth:`save` wrote (a :class:`~kvjax.checkpoint.CheckpointError` for
        anything else, or a corrupt or unfinished checkpoint)."""
        arrays, record = load_arrays(path, kind=KIND)
        meta = record["metadata"]
        try:
            return cls(candidates=tuple(meta["candidates"]), bits=meta["bits"],
                       loss=arrays["loss"], metric=meta["metric"], base=meta["base"])
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{path}: not layer sensitivities ({err})") from err


@dataclasses.dataclass(frozen=True)
class Allocation:
    """A codec per unit: ``choice[layer][role]`` indexes the candidates; ``bits`` the
    mean bits per element, ``predicted`` the summed losses of the choices; ``spec`` the
    cache spec."""

    choice: tuple[tuple[int, int], ...]
    bits: float
    predicted: float
    spec: str


def check_budget(bits: dict[str, Sequence[float]], budget: float) -> None:
    """``ValueError`` unless ``budget`` (bits per element) is a finite number that the
    cheapest candidates of ``bits[role][c]`` fit: what :func:`allocate` needs, known
    before any sensitivity is measured."""
    if not (isinstance(budget, (int, float)) and math.isfinite(budget) and budget > 0):
        raise ValueError(f"a budget is a finite number of bits per element > 0, got "
                         f"{budget!r}")
    cheapest = sum(min(round(b / STEP) for b in bits[r]) for r in ROLES) * STEP / 2
    if cheapest > budget + 1e-9:
        raise ValueError(f"a budget of {budget:g} bits per element is below the cheapest "
                         f"choice ({cheapest:.3f})")


def allocate(sensitivity: Sensitivity, budget: float) -> Allocation:
    """The choice of minimum summed loss whose mean bits per element is at most
    ``budget``; ``ValueError`` when even the cheapest candidates exceed it
    (:func:`check_budget`)."""
    check_budget(sensitivity.bits, budget)
    layers = sensitivity.num_layers
    units = [(layer, r) for layer in range(layers) for r in range(2)]
    costs = [[round(sensitivity.bits[ROLES[r]][c] / STEP)
              for c in range(len(sensitivity.candidates))] for _, r in units]
    # a budget above every unit's dearest choice buys nothing more: the table stops there
    capacity = min(int(np.floor(budget * len(units) / STEP + 1e-9)),
                   sum(max(c) for c in costs))
    # best[s]: the least loss of the units so far spending exactly s; choices kept per unit
    best = np.full(capacity + 1, np.inf)
    best[0] = 0.0
    picks = []
    for (layer, r), cost in zip(units, costs, strict=True):
        new = np.full_like(best, np.inf)
        pick = np.full(capacity + 1, -1)
        for c, spend in enumerate(cost):
            if spend > capacity:
                continue
            shifted = np.full_like(best, np.inf)
            shifted[spend:] = best[:capacity + 1 - spend] + sensitivity.loss[layer, r, c]
            better = shifted < new
            new[better], pick[better] = shifted[better], c
        best = new
        picks.append(pick)
    spent = int(np.argmin(best))
    predicted = float(best[spent])
    chosen = []
    for pick, cost in zip(reversed(picks), reversed(costs), strict=True):
        c = int(pick[spent])
        chosen.append(c)
        spent -= cost[c]
    chosen = chosen[::-1]
    choice = tuple((chosen[2 * layer], chosen[2 * layer + 1]) for layer in range(layers))
    bits = float(np.mean([sensitivity.bits[ROLES[r]][choice[layer][r]]
                          for layer, r in units]))
    return Allocation(choice=choice, bits=bits, predicted=predicted,
                      spec=allocation_spec(sensitivity, choice))


def allocation_spec(sensitivity: Sensitivity, choice: Sequence[Sequence[int]]) -> str:
    """The cache spec of a choice: for K and V the most common codec as the default and
    a ``layers[...]`` rule for each other codec."""
    clauses, rules = [], []
    for r, role in enumerate(ROLES):
        picked = [pair[r] for pair in choice]
        default = Counter(picked).most_common(1)[0][0]
        clauses.append(f"{role}={sensitivity.codec(role, default)}")
        for c in sorted(set(picked) - {default}):
            layers = ",".join(str(i) for i, p in enumerate(picked) if p == c)
            rules.append(f"layers[{layers}]:{role}={sensitivity.codec(role, c)}")
    return " ".join(clauses + rules)


__all__ = ["KIND", "ROLES", "STEP", "Allocation", "Sensitivity", "allocate", "allocation_spec",
           "check_budget"]
