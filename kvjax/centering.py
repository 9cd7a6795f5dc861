"""Key centering and channel smoothing: exact transforms of the keys a cache stores.

Keys of many models carry a large, position-stable component in a few channels (a k
projection bias, the low-frequency RoPE pairs that barely rotate): a per-vector codec
then spends its range, or a rotation its norm, on a component that is the same for every
token. Two transforms remove it without changing attention:

- **Centering** stores ``k - mu`` for one vector ``mu`` per (row, layer, kv head). Each
  query's scores change by the constant ``q . mu``, which softmax ignores, so attention
  over the centered keys equals attention over the keys (up to the codec's error, now on
  a smaller vector). No reader adds ``mu`` back; the fused kernels read the centered
  codes as they read any codes.
- **Smoothing** stores ``k / s`` for a per-channel scale ``s`` and attention multiplies
  the query by ``s`` instead: ``(q * s) . (k / s) = q . k`` exactly. Channels of very
  different spread come out alike, so a token-wise codec's range is not set by one wide
  channel. ``s`` is the channel's RMS (about the centre where keys are centered, about
  zero otherwise: the spread of what is stored) to the power :data:`SMOOTH_POWER`,
  normalized to a geometric mean of 1 (:func:`smoothing_scale`).

Where ``mu`` and ``s`` come from (the cache spec's ``center=`` and ``smooth=`` clauses):

- ``first``: from each row's first append (the prompt's first chunk), per row, before
  anything is stored; the statistics skip the row's first token when the chunk has
  others (the BOS / attention-sink token's key is atypical in many models) and are
  robust (:func:`robust_statistics`): a value more than :data:`ROBUST_LIMIT` robust
  deviations from its channel's median is left out of the mean and RMS, so one corrupt
  key cannot move the centre every later key is stored about, and the row is flagged
  (``kvjax.cache.STATISTICS_OUTLIERS``, reported by ``kvjax.cache.check``).
- ``calib``: from a calibration run (:class:`KeyCalibration`, built by
  :func:`kvjax.cache.key_calibration` from a cache that holds calibration text), per
  (layer, kv head), the same for every row.

Either way the vectors are fixed before the first key of a row is stored, which is what
makes the transforms exact; both are kept in bf16 (any value works exactly: the keys and
the query use the same one) and counted by :func:`kvjax.cache.stored_bits`.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import zipfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

#: where a transform's statistics come from (the ``center=`` / ``smooth=`` clause values)
MODES = ("first", "calib")
#: the storage type of ``mu`` and ``s``
DTYPE = jnp.bfloat16
#: ``s = rms ** SMOOTH_POWER``: 1 would make every channel's spread equal; a half (the
#: usual migration strength of activation smoothing) keeps the wide channels somewhat
#: wider, which keeps their share of the codec's error in proportion to their weight in
#: the scores
SMOOTH_POWER = 0.5
#: channel scales below this fraction of the largest are raised to it: a channel that
#: is all but constant in the statistics must not be blown up by a huge ``1 / s``
SMOOTH_FLOOR = 1e-2
#: a first chunk's value further than this many robust deviations (1.4826 x the median
#: absolute deviation, floored) from its channel's median is left out of the statistics.
#: Real keys stay far inside (``python experiments/key_deviations.py``: SmolLM2-135M's
#: over Shakespeare, docs/outliers.md), so clean statistics are the plain ones
ROBUST_LIMIT = 64.0
#: the robust deviation of a channel is at least this fraction of the mean robust
#: deviation of its head's channels: a channel all but constant over the chunk does not
#: turn every small wobble into an outlier
ROBUST_FLOOR = 0.1


def check_mode(name: str, mode: str) -> str:
    """``mode`` if it is '' (off) or one of :data:`MODES`; else a ``ValueError``."""
    if mode not in ("", *MODES):
        raise ValueError(f"{name}={mode!r}: valid values are {', '.join(MODES)}")
    return mode


def statistics(x: jax.Array, weight: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Weighted per-channel mean and RMS about it of ``x[..., T, D]`` over its tokens,
    ``weight[..., T]`` (0/1; or ``[..., T, D]``, per value); ``(mean, rms)`` each
    ``[..., D]`` float32 (zeros where no token has weight)."""
    w = weight.astype(jnp.float32)
    if w.ndim < x.ndim:
        w = w[..., None]
    count = jnp.maximum(jnp.sum(w, axis=-2), 1.0)
    x = x.astype(jnp.float32)
    mean = jnp.sum(w * x, axis=-2) / count
    rms = jnp.sqrt(jnp.sum(w * jnp.square(x - mean[..., None, :]), axis=-2) / count)
    return mean, rms


def _weighted_median(x: jax.Array, weight: jax.Array) -> jax.Array:
    """Median over axis -2 of ``x[..., T, D]`` counting the entries where ``weight`` (of
    ``x``'s shape) is set: the mean of the two middle ones for an even count, 0 where
    none counts."""
    count = jnp.sum(weight, axis=-2, keepdims=True)  # [..., 1, D]
    ordered = jnp.sort(jnp.where(weight, x, jnp.inf), axis=-2)
    low = jnp.take_along_axis(ordered, jnp.maximum(count - 1, 0) // 2, axis=-2)
    high = jnp.take_along_axis(ordered, count // 2 - (count == 0), axis=-2)
    return jnp.where(count > 0, (low + high) / 2, 0.0)[..., 0, :]


def robust_deviations(x: jax.Array, weight: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(deviations, counted)`` of ``x[..., T, D]`` over the tokens ``weight[..., T]``
    selects: each value's distance from its channel's median in robust deviations
    (1.4826 x the median absolute deviation, floored at :data:`ROBUST_FLOOR` of the
    head's mean), and which values count (selected and finite)."""
    x = x.astype(jnp.float32)
    counted = jnp.broadcast_to(weight[..., None], x.shape) & jnp.isfinite(x)
    deviation = jnp.abs(x - _weighted_median(x, counted)[..., None, :])
    spread = 1.4826 * _weighted_median(deviation, counted)
    floor = ROBUST_FLOOR * jnp.mean(spread, axis=-1, keepdims=True)
    spread = jnp.maximum(jnp.maximum(spread, floor), jnp.finfo(jnp.float32).tiny)
    return deviation / spread[..., None, :], counted


def robust_statistics(x: jax.Array, weight: jax.Array
                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`statistics` of ``x[..., T, D]`` over the tokens ``weight[..., T]`` selects,
    leaving out every value further than :data:`ROBUST_LIMIT` robust deviations from its
    channel's median (:func:`robust_deviations`), and non-finite values. Returns
    ``(mean, rms, outlying)``, ``outlying[...]`` whether any value was left out."""
    x = x.astype(jnp.float32)
    deviations, counted = robust_deviations(x, weight)
    outlying = counted & (deviations > ROBUST_LIMIT)
    # left out, not clipped: a clipped value still moves a short chunk's mean by
    # ROBUST_LIMIT / tokens spreads; at least half the values lie within one spread
    inlying = counted & ~outlying
    mean, rms = statistics(jnp.where(inlying, x, 0.0), inlying)
    return mean, rms, jnp.any(outlying, axis=(-2, -1))


def smoothing_scale(rms: jax.Array) -> jax.Array:
    """Per-channel scales ``s[..., D]`` from the channels' RMS: ``rms ** SMOOTH_POWER``,
    floored at :data:`SMOOTH_FLOOR` of the largest, divided by their geometric mean (so
    the transform moves no overall magnitude between the keys and the query); all ones
    where every RMS is zero."""
    s = jnp.power(jnp.maximum(rms.astype(jnp.float32), 0.0), SMOOTH_POWER)
    top = jnp.max(s, axis=-1, keepdims=True)
    s = jnp.maximum(s, SMOOTH_FLOOR * top)
    log_mean = jnp.mean(jnp.log(jnp.where(top > 0, s, 1.0)), axis=-1, keepdims=True)
    return jnp.where(top > 0, s / jnp.exp(log_mean), 1.0)


def first_chunk_weights(valid: jax.Array, num_tokens: int) -> jax.Array:
    """``[B, T]`` weights of a row's first chunk for its statistics: its valid tokens,
    without the first one when the chunk holds more than one."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)[None, :]
    skip_first = (valid > 1)[:, None]
    return (t < valid[:, None]) & ~(skip_first & (t == 0))


@dataclasses.dataclass(frozen=True)
class KeyCalibration:
    """Per (layer, kv head) key statistics from a calibration run, for ``calib`` modes.

    ``center``: ``float32[L, K, D]`` the mean key; ``rms``: ``float32[L, K, D]`` each
    channel's RMS about it; ``tokens``: how many tokens (all rows together) the
    statistics cover. :meth:`scale` gives the smoothing scales.
    """

    center: np.ndarray
    rms: np.ndarray
    tokens: int

    def __post_init__(self):
        center = np.asarray(self.center, np.float32)
        rms = np.asarray(self.rms, np.float32)
        if center.ndim != 3 or center.shape != rms.shape:
            raise ValueError("a key calibration holds center and rms of one shape "
                             f"[layers, kv heads, head dim], got {center.shape} and "
                             f"{rms.shape}")
        if not (np.isfinite(center).all() and np.isfinite(rms).all() and (rms >= 0).all()):
            raise ValueError("a key calibration must be finite with non-negative rms")
        object.__setattr__(self, "center", center)
        object.__setattr__(self, "rms", rms)

    def scale(self, centered: bool) -> np.ndarray:
        """``float32[L, K, D]`` smoothing scales of keys stored centered or not."""
        rms = self.rms if centered else np.sqrt(self.rms**2 + self.center**2)
        # concrete statistics give concrete scales, also while a caller traces
        with jax.ensure_compile_time_eval():
            return np.asarray(smoothing_scale(jnp.asarray(rms)))

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(layers, kv heads, head dim)``."""
        return tuple(self.center.shape)

    def save(self, path: str | Path) -> None:
        """Write to an ``.npz`` file (:meth:`load` reads it back), named as given: written
        beside it and renamed into place, so an interrupted save leaves what was there.
        ``ValueError`` for an empty path or a directory."""
        if not str(path).strip():
            raise ValueError("a calibration file path must not be empty")
        path = Path(path)
        if path.is_dir():
            raise ValueError(f"{path} is a directory: name the calibration file (.npz)")
        fd, staging = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".saving",
                                       dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as out:
                np.savez(out, center=self.center, rms=self.rms, tokens=self.tokens)
            os.replace(staging, path)
        finally:
            if os.path.exists(staging):
                os.unlink(staging)

    @classmethod
    def load(cls, path: str | Path) -> KeyCalibration:
        """Read a file written by :meth:`save`. Anything else (another file, a missing or
        mistyped array, a truncated or corrupt archive, non-finite statistics) is one
        ``ValueError`` naming the file and what is wrong; a missing file is an
        ``OSError``."""
        path = Path(path)

        def wrong(why: str) -> ValueError:
            return ValueError(f"{path}: not a key calibration file ({why}; "
                              "python -m kvjax calibrate writes one)")

        if path.is_dir():
            raise wrong("a directory")
        try:
            data = np.load(path, allow_pickle=False)
        except FileNotFoundError:
            raise
        except (ValueError, OSError, EOFError, zipfile.BadZipFile) as err:
            raise wrong(f"unreadable: {type(err).__name__}") from None
        if not isinstance(data, np.lib.npyio.NpzFile):
            raise wrong("a single array, not an .npz archive")
        with data:
            missing = sorted({"center", "rms", "tokens"} - set(data.files))
            if missing:
                raise wrong(f"no {', '.join(missing)} array")
            try:
                arrays = {name: data[name] for name in ("center", "rms", "tokens")}
            except (ValueError, OSError, EOFError, zipfile.BadZipFile) as err:
                raise wrong(f"an unreadable array: {type(err).__name__}") from None
        for name in ("center", "rms", "tokens"):
            if arrays[name].dtype.kind not in "fiu":
                raise wrong(f"{name} holds {arrays[name].dtype} values, not numbers")
        if arrays["tokens"].shape != () or arrays["tokens"] < 0:
            raise wrong("tokens must be one non-negative count")
        try:
            return cls(center=arrays["center"], rms=arrays["rms"],
                       tokens=int(arrays["tokens"]))
        except ValueError as err:
            raise wrong(str(err)) from None


__all__ = [
    "DTYPE",
    "MODES",
    "ROBUST_FLOOR",
    "ROBUST_LIMIT",
    "SMOOTH_FLOOR",
    "SMOOTH_POWER",
    "KeyCalibration",
    "check_mode",
    "first_chunk_weights",
    "robust_deviations",
    "robust_statistics",
    "smoothing_scale",
    "statistics",
]
