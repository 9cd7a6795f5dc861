"""HyperQuant, ``hyperquant:LATTICE,RATEbps[,ROTATION][,dither][,int8][,tileN][,tN][,mX]``:
lattice quantization of rotated, normalized vectors, bit-stripped and Rice coded.

Encode path of one vector ``x[D]`` (the paper's Figure 1, KV side):

1. **Randomized Hadamard transform** per tile of ``tileN`` coordinates (default: the head
   dim), seeded signs per (layer, kv head, K|V).
2. **Rotation** ``none`` (default), ``signs`` (a seeded +-1 diagonal) or ``haar`` (a seeded
   Haar-random orthogonal ``D x D``: the paper's "qjl" rotation).
3. **Normalize**: ``|x|`` is stored in fp16 and the unit vector scaled to
   ``Y = alpha sqrt(D) x / |x|``, so that ``Y``'s coordinates have mean square ``alpha^2``.
   ``alpha = sqrt(sigma_q^2 10^(SNR / 10))``, ``sigma_q^2`` the lattice's per-coordinate
   noise power (:attr:`kvjax.primitives.lattices.Lattice.noise_power`), and the SNR is the one the
   rate calibration maps the target rate to.
4. **Dither** (``dither``): ``U``, uniform on the lattice's Voronoi cell, is added before
   quantizing and subtracted after. It is drawn from a seeded key (a parameter) folded
   with a hash of the fp16 norms of the vector's block and its place in the block, so
   the decoder regenerates it from what is stored; for a fixed vector it is uniform over
   the draw of the key, and the reconstruction is then exactly unbiased
   (Schuchman; Zamir and Feder): ``E[<q, x_hat>] = <q, x>`` for every cached ``x``.
5. **Quantize** each run of ``n`` coordinates to the closest point of ``LATTICE`` in
   ``{z, a2, d4, e8}`` (:mod:`kvjax.primitives.lattices`, integer realizations).
6. **Strip** the bits membership pins (:meth:`kvjax.primitives.lattices.Lattice.strip`).
7. **Rice code** (:mod:`kvjax.primitives.rice`) the symbols of a block of ``tN`` tokens (default 8)
   in sub-streams of at most 512 symbols, each with the Rice parameter(s) that code it
   in the fewest bits (``e8``, ``z``: one ``k``; ``d4``: ``k`` and ``k - 1`` for the
   halved symbol; ``a2``: one each for ``t_y`` and ``n_x``).

Rate calibration. The Rice rate is a monotone function of the SNR. For each (lattice,
head dim, block geometry, dither) it is measured once on iid Gaussian vectors (which the
rotation and normalization make every input look like) over a 0.25 dB grid, and
inverted by interpolation. Head dims 64 and 128 at the default block ship with the
package (``kvjax/data/hyperquant_calibration.npz``); other geometries are measured on
first use (seconds) and kept on disk next to the Lloyd-Max codebooks.
``RATEbps`` (1.5..5) is the realized Rice payload per element, to about 0.01 bps on
Gaussian data.

Fixed capacity. A cache stores codes in fixed block slots, so each block of
``tN`` tokens gets a budget of ``W`` 32-bit words: the calibrated mean payload of a
block plus ``mX`` (default 4) standard deviations of it. A block whose code does not fit
falls back to whichever candidate reconstructs it best (the least squared error of its
vectors, measured at encode) among the coarser scales ``alpha 2^(-j/2)``, ``j = 1, 2, 3``
(each step about 0.5 bps fewer) whose code fits, and the *sign fallback*: its rotated
coordinates' signs (1 bit each, which always fits since the budget is at least 1.5 bits
per element) and, in the words they leave free, each token's ``mean |Y|`` on an
``(c + 1) / 256`` grid (fewer bits when the budget is that tight; ``sqrt(2 / pi)`` when
there is no room). The signs matter for spiky vectors: a single large coordinate
becomes, rotated, a flat vector of equal magnitudes that a coarse lattice rounds to zero
and the signs with their scale keep exactly. The level is stored, so nothing is ever
truncated: a fallback costs precision for that block only, and a code too long to
count (Rice lengths saturate, :mod:`kvjax.primitives.rice`) never fits.
:meth:`HyperQuantCodec.fallback_blocks` counts them.

Codes of ``x[..., T, D]`` (``T`` a multiple of the block), ``nb = T / tN``::

    stream  uint32[..., nb, W]       the block's sub-streams, back to back
    index   uint32[..., nb, n_sub]   per sub-stream: start bit (bits 0..23), k (24..27),
                                     second k (28..31); sub-stream 0 starts at bit 0, so
                                     its start field holds the block's fallback level
    norm    float16[..., nb, tN]

Bits per element: ``32 (W + n_sub) / (tN D) + 16 / D``: the budget, not the realized
rate, is what a fixed-capacity cache holds (:meth:`HyperQuantCodec.payload_bits` measures
the realized rate from the stored words).

``int8``: no entropy coding; the lattice codes themselves are stored in 8 bits (clamped
to +-127, the paper's fallback for Tensor-Core formats) at the SNR of ``RATEbps``, biased
by 128 and packed four to a word (:func:`kvjax.primitives.packing.pack_codes`, the
layout of ``int:8``)::

    codes   uint32[..., T, D / 4]    norm  float16[..., T, 1]          8 + 16 / D bits

so that the INT decode kernel reads them (:meth:`HyperQuantCodec.kernel_formats`:
without dither, a token is ``R^T (norm (c - 128))`` with ``R`` the rotation, the
lattice's point scale and ``1 / (alpha sqrt D)`` folded into one matrix).

Values use the same codec (the paper's symmetric K = V).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.codec import (
    EXACT,
    FP16_MAX,
    Codec,
    CodecError,
    Codes,
    Example,
    IntFormat,
    KernelFormat,
    Limits,
    Option,
    Params,
    RiceFormat,
    register,
)
from kvjax.codecs.intn import exact_bits
from kvjax.codecs.rotated import stored_norm
from kvjax.primitives import rice
from kvjax.primitives.codebooks import codebook_dir
from kvjax.primitives.lattices import LATTICES, Lattice, lattice
from kvjax.primitives.packing import pack_codes, unpack_codes
from kvjax.primitives.rice_blocks import (
    LADDER,
    SIGN_LEVEL,
    RiceLayout,
    reconstruct,
    rotated_tokens,
    sign_scale_codes,
    sign_scales,
    sign_words,
    symbol_classes,
    symbol_parameters,
)
from kvjax.primitives.rotations import (
    haar_orthogonal,
    inverse_randomized_hadamard,
    random_signs,
    randomized_hadamard,
)

MIN_RATE, MAX_RATE = 1.5, 5.0
ROTATIONS = ("none", "signs", "haar")
#: the bias of stored int8 codes: ``c + 128`` in 1..255
INT8_BIAS = 128
#: symbols per Rice sub-stream (the paper's S)
SUBSTREAM = 512
#: most bits of a token's scale in the sign fallback
SIGN_SCALE_BITS = 8
#: calibration grid (dB) and sample size (Gaussian vectors)
SNR_GRID = np.arange(-5.0, 40.0 + 1e-9, 0.25)
CALIBRATION_VECTORS = 8192
DEFAULT_BLOCK_TOKENS = 8
DEFAULT_MARGIN = 4.0


def substreams(symbols: int, point_dim: int = 1) -> tuple[int, int]:
    """``(n_sub, S)``: the fewest sub-streams of at most 512 symbols (when possible) that
    split ``symbols`` evenly into whole lattice points of ``point_dim`` coordinates."""
    n = -(-symbols // SUBSTREAM)
    while symbols % n or (symbols // n) % point_dim:
        n += 1
    return n, symbols // n


# -- shared math: scale, symbols, Rice parameters, payload ---------------------------


def alpha_for_snr(lat: Lattice, snr_db: float) -> float:
    """Scale that puts the per-coordinate signal power ``snr_db`` above the lattice noise."""
    return math.sqrt(lat.noise_power * 10.0 ** (snr_db / 10.0))


def stream_parameters(lat: Lattice, symbols: jax.Array, classes: np.ndarray):
    """Rice parameters ``(k1, k2)`` (int32 ``[...]``) of sub-streams ``symbols[..., S]``.

    ``e8``/``z``: one parameter (``k2 = 0``); ``d4``: ``k2 = max(k1 - 1, 0)`` for the halved
    symbol, ``k1`` chosen for the total; ``a2``: each class its own best parameter.
    """
    first = jnp.asarray(classes == 0)
    if lat.name in ("e8", "z"):
        return rice.best_parameter(symbols), jnp.zeros(symbols.shape[:-1], jnp.int32)
    cost0 = rice.parameter_costs(symbols, first)
    cost1 = rice.parameter_costs(symbols, ~first)
    if lat.name == "d4":
        shifted = jnp.concatenate([cost1[..., :1], cost1[..., :-1]], axis=-1)
        k1 = jnp.argmin(rice.saturating_add(cost0, shifted), axis=-1).astype(jnp.int32)
        return k1, jnp.maximum(k1 - 1, 0)
    return (jnp.argmin(cost0, -1).astype(jnp.int32), jnp.argmin(cost1, -1).astype(jnp.int32))


def quantize_symbols(lat: Lattice, y: jax.Array, dither: jax.Array | None):
    """Closest lattice codes of ``y[..., D]`` (+ dither), and their stripped symbols."""
    shape = y.shape
    pts = y if dither is None else y + dither
    codes = lat.closest(pts.reshape(*shape[:-1], shape[-1] // lat.dim, lat.dim))
    return codes, lat.strip(codes).reshape(shape)


def block_payload(lat: Lattice, symbols: jax.Array, n_sub: int):
    """Rice parameters and payload bits of blocks of symbols ``[..., N]``.

    Returns ``(k1, k2, bits)``: ``[..., n_sub]`` twice and int32 ``[...]`` (saturating:
    :func:`kvjax.primitives.rice.saturating_sum`, so an over-long code never fits).
    """
    size = symbols.shape[-1] // n_sub
    streams = symbols.reshape(*symbols.shape[:-1], n_sub, size)
    classes = symbol_classes(lat, size)
    k1, k2 = stream_parameters(lat, streams, classes)
    return k1, k2, rice.code_length(streams, symbol_parameters(k1, k2, classes))


# -- rate calibration -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Realized Rice payload vs SNR on iid Gaussian vectors for one block geometry.

    Attributes:
        snr_db: the grid, float64 ``[P]``.
        rate: mean payload bits per element at each SNR.
        block_std: standard deviation of one block's payload bits at each SNR.
        block_elements: elements per block (``tN * D``).
    """

    snr_db: np.ndarray
    rate: np.ndarray
    block_std: np.ndarray
    block_elements: int

    def snr_for_rate(self, rate: float) -> float:
        """The SNR whose calibrated rate is ``rate`` (linear interpolation)."""
        if not self.rate[0] <= rate <= self.rate[-1]:
            raise CodecError(f"rate {rate} bps is outside the calibrated range "
                             f"{self.rate[0]:.3f}..{self.rate[-1]:.3f}")
        return float(np.interp(rate, self.rate, self.snr_db))

    def std_at(self, snr_db: float) -> float:
        """Block payload standard deviation (bits) at ``snr_db``."""
        return float(np.interp(snr_db, self.snr_db, self.block_std))


def _calibration_file(name: str, head_dim: int, block_tokens: int, dither: bool) -> Path:
    text = (f"hyperquant-{name}-d{head_dim}-t{block_tokens}-s{SUBSTREAM}-dither{int(dither)}"
            f"-n{CALIBRATION_VECTORS}-g{SNR_GRID[0]:g}_{SNR_GRID[-1]:g}_{len(SNR_GRID)}")
    return codebook_dir() / (re.sub(r"[^A-Za-z0-9.+-]+", "_", text) + ".npz")


#: tables that ship with the package (head dims 64 and 128, the default block), so that
#: the common geometries need no measurement; :func:`write_shipped_calibrations` makes it
SHIPPED = Path(__file__).resolve().parent.parent / "data" / "hyperquant_calibration.npz"
SHIPPED_HEAD_DIMS = (64, 128)


def _shipped_key(name: str, head_dim: int, block_tokens: int, dither: bool) -> str:
    return f"{name}-d{head_dim}-t{block_tokens}-s{SUBSTREAM}-dither{int(dither)}"


def _read_shipped(key: str, elements: int) -> Calibration | None:
    try:
        with np.load(SHIPPED) as f:
            if f"{key}/rate" not in f.files or not np.array_equal(f["snr_db"], SNR_GRID):
                return None
            return Calibration(f["snr_db"], f[f"{key}/rate"], f[f"{key}/block_std"], elements)
    except (OSError, ValueError):
        return None


def write_shipped_calibrations(path: Path = SHIPPED) -> Path:
    """Measure every lattice x head dim in :data:`SHIPPED_HEAD_DIMS` x dither at the
    default block and write them to ``path`` (the file the package ships)."""
    arrays = {"snr_db": SNR_GRID}
    for name in LATTICES:
        for head_dim in SHIPPED_HEAD_DIMS:
            for dither in (False, True):
                key = _shipped_key(name, head_dim, DEFAULT_BLOCK_TOKENS, dither)
                rate, std = measure_calibration(name, head_dim, DEFAULT_BLOCK_TOKENS, dither)
                arrays[f"{key}/rate"], arrays[f"{key}/block_std"] = rate, std
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        np.savez_compressed(f, **arrays)
    return path


@functools.cache
def calibration(name: str, head_dim: int, block_tokens: int = DEFAULT_BLOCK_TOKENS,
                dither: bool = False) -> Calibration:
    """The rate calibration of lattice ``name`` for blocks of ``block_tokens`` vectors of
    ``head_dim``: shipped with the package for the common geometries, else measured once
    (a few seconds) and kept on disk (see the module doc)."""
    elements = block_tokens * head_dim
    shipped = _read_shipped(_shipped_key(name, head_dim, block_tokens, dither), elements)
    if shipped is not None:
        return shipped
    path = _calibration_file(name, head_dim, block_tokens, dither)
    try:
        with np.load(path) as f:
            cal = Calibration(f["snr_db"], f["rate"], f["block_std"], int(f["block_elements"]))
        if cal.rate.shape == SNR_GRID.shape and cal.block_elements == elements:
            return cal
    except (OSError, KeyError, ValueError):
        pass
    rate, std = measure_calibration(name, head_dim, block_tokens, dither)
    cal = Calibration(SNR_GRID.copy(), rate, std, elements)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            np.savez(f, snr_db=cal.snr_db, rate=cal.rate, block_std=cal.block_std,
                     block_elements=elements)
        os.replace(tmp, path)
    except OSError:
        pass
    return cal


def measure_calibration(name: str, head_dim: int, block_tokens: int, dither: bool):
    """``(rate, block_std)`` over :data:`SNR_GRID` on :data:`CALIBRATION_VECTORS` seeded
    Gaussian vectors (the same at every SNR, which keeps the curve monotone)."""
    # the first use may come from inside a traced encode: measure eagerly all the same
    with jax.ensure_compile_time_eval():
        rate, std = _measure_rates(lattice(name), head_dim, block_tokens, dither)
    return np.maximum.accumulate(rate), std


def _measure_rates(lat: Lattice, head_dim: int, block_tokens: int, dither: bool):
    n_blocks = CALIBRATION_VECTORS // block_tokens
    elements = block_tokens * head_dim
    n_sub, _ = substreams(elements, lat.dim)
    key = jax.random.key(20260)
    x = jax.random.normal(key, (n_blocks, block_tokens, head_dim), jnp.float32)
    y = x * (math.sqrt(head_dim) / jnp.linalg.norm(x, axis=-1, keepdims=True))
    u = (lat.voronoi_sample(jax.random.fold_in(key, 1), (n_blocks, block_tokens,
                                                         head_dim // lat.dim))
         .reshape(y.shape) if dither else None)

    @jax.jit
    def bits_at(alpha):
        _, symbols = quantize_symbols(lat, alpha * y, u)
        return block_payload(lat, symbols.reshape(n_blocks, elements), n_sub)[2]

    rates, stds = [], []
    for snr in SNR_GRID:
        bits = np.asarray(bits_at(jnp.float32(alpha_for_snr(lat, float(snr)))), np.float64)
        rates.append(bits.mean() / elements)
        stds.append(bits.std())
    return np.array(rates), np.array(stds)


# -- the codec ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything static that encode/decode need for one head dim."""

    alpha: float
    snr_db: float
    words: int
    n_sub: int
    substream: int
    tile: int
    #: bits of each token's scale in the sign fallback (0: no room, a fixed scale)
    sign_scale_bits: int


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class HyperQuantCodec(Codec):
    """HyperQuant at a target Rice rate (see the module docstring)."""

    name: ClassVar[str] = "hyperquant"
    #: the norm is stored in fp16
    limits: ClassVar[Limits] = Limits(norm=FP16_MAX)
    options: ClassVar[tuple[Option, ...]] = (
        Option.choice("lattice", LATTICES, "lattice", "LATTICE"),
        Option.suffix("rate", "bps", "rate", "RATE", type=float, lo=MIN_RATE, hi=MAX_RATE),
        Option.choice("rotation", ROTATIONS, "rotation"),
        Option.word("dither", "dither", "dither"),
        Option.word("int8", "int8", "int8 storage"),
        Option.flag("tile", "tile", "Hadamard tile", "N", lo=1,
                    note="tileN a power of two >= the lattice dim (default the head dim)"),
        Option.flag("block_tokens", "t", "tokens per block", "N", lo=1, hi=256),
        Option.flag("margin", "m", "margin", "X", type=float, lo=0, hi=20),
    )
    examples: ClassVar[tuple[Example, ...]] = (
        Example("hyperquant:e8,2bps", rel_mse=0.14, seeded=True, bad_head_dims=(48,)),
        Example("hyperquant:d4,3bps,signs,t2", rel_mse=0.04, head_dim=32, seeded=True,
                bad_head_dims=(24,)),
        Example("hyperquant:z,2bps,haar,tile16,m0", rel_mse=0.2, seeded=True,
                bad_head_dims=(40,)),
        Example("hyperquant:a2,4bps,dither,int8", rel_mse=0.01, seeded=True,
                bad_head_dims=(48,)),
    )
    decode_note: ClassVar[str] = (
        "the Rice-coded stream (without int8) decodes slowly: where each element starts "
        "is known only after the ones before it, so its kernel (rice_decode) attends at "
        "0.022x cuDNN bf16's speed (H200, B=32, S=32k; docs/kernels.md). For speed store "
        "the same lattice codes as int8: hyperquant:e8,4bps,int8 decodes through the INT "
        "kernel at 1.75x cuDNN bf16 (without dither, which has no kernel)")

    lattice: str
    rate: float
    rotation: str = "none"
    dither: bool = False
    int8: bool = False
    tile: int | None = None
    block_tokens: int = DEFAULT_BLOCK_TOKENS  # type: ignore[misc]
    margin: float = DEFAULT_MARGIN

    def validate(self) -> None:
        """The tile is a power of two that holds whole lattice points; with ``int8``
        every vector is a block of its own and no budget applies (``t`` and ``m`` are
        set to 1 and the default)."""
        if self.tile is not None and (self.tile & (self.tile - 1)
                                      or self.tile < lattice(self.lattice).dim):
            raise CodecError(f"{self.name}: tile must be a power of two >= the lattice "
                             f"dimension, got {self.tile!r}")
        if self.int8:
            object.__setattr__(self, "block_tokens", 1)
            object.__setattr__(self, "margin", DEFAULT_MARGIN)

    @property
    def lat(self) -> Lattice:
        """The :class:`~kvjax.primitives.lattices.Lattice`."""
        return lattice(self.lattice)

    # -- spec ------------------------------------------------------------------------
    def spec_values(self) -> dict[str, Any]:
        """The declared options, but ``tN`` and ``mX`` only without ``int8``."""
        values = super().spec_values()
        if self.int8:
            del values["block_tokens"], values["margin"]
        return values

    # -- geometry ----------------------------------------------------------------------
    def check_head_dim(self, head_dim: int) -> None:
        """A multiple of the tile, the tile (default ``head_dim``) a power of two."""
        Codec.check_head_dim(self, head_dim)
        tile = self.tile or head_dim
        if tile & (tile - 1) or tile < self.lat.dim or head_dim % tile:
            raise CodecError(
                f"{self.spec}: head_dim {head_dim} needs a power-of-two Hadamard tile "
                f">= {self.lat.dim} that divides it (tile {tile}); set tileN")

    def plan(self, head_dim: int) -> _Plan:
        """Scale, SNR and block budget for ``head_dim`` (from the calibration)."""
        self.check_head_dim(head_dim)
        return _plan(self, head_dim)

    # -- the protocol ------------------------------------------------------------------
    def init(self, key: jax.Array, head_dim: int) -> Params:
        """``rht_signs`` float32[D]; ``rotation`` (float32[D] signs or [D, D] Haar) unless
        ``none``; ``dither_key`` uint32[2] with dither."""
        self.check_head_dim(head_dim)
        k_rht, k_rot, k_dither = jax.random.split(key, 3)
        params = {"rht_signs": random_signs(k_rht, head_dim)}
        if self.rotation == "signs":
            params["rotation"] = random_signs(k_rot, head_dim)
        elif self.rotation == "haar":
            params["rotation"] = haar_orthogonal(k_rot, head_dim)
        if self.dither:
            params["dither_key"] = jax.random.bits(k_dither, (2,), jnp.uint32)
        return params

    def _rotate(self, params: Params, unit: jax.Array, tile: int) -> jax.Array:
        y = randomized_hadamard(unit, params["rht_signs"], block=tile)
        if self.rotation == "signs":
            y = y * params["rotation"]
        elif self.rotation == "haar":
            y = jnp.einsum("...d,de->...e", y, params["rotation"], precision=EXACT)
        return y

    def _unrotate(self, params: Params, y: jax.Array, tile: int) -> jax.Array:
        if self.rotation == "signs":
            y = y * params["rotation"]
        elif self.rotation == "haar":
            y = jnp.einsum("...e,de->...d", y, params["rotation"], precision=EXACT)
        return inverse_randomized_hadamard(y, params["rht_signs"], block=tile)

    def _dither(self, params: Params, norm: jax.Array, head_dim: int) -> jax.Array:
        """Dither ``[..., nb, tN, D]`` from the key and the block's stored norms
        ``norm[..., nb, tN]`` (float32 values of fp16 numbers)."""
        bits = jax.lax.bitcast_convert_type(norm.astype(jnp.float16), jnp.uint16)
        block_hash = _mix(bits.astype(jnp.uint32))  # [..., nb]
        tokens = norm.shape[-1]
        seeds = block_hash[..., None] * jnp.uint32(0x9E3779B1) + jnp.arange(
            tokens, dtype=jnp.uint32)
        base = jax.random.wrap_key_data(params["dither_key"], impl="threefry2x32")
        lat = self.lat

        def one(seed):
            return lat.voronoi_sample(jax.random.fold_in(base, seed),
                                      (head_dim // lat.dim,)).reshape(head_dim)

        flat = jax.vmap(one)(seeds.reshape(-1))
        return flat.reshape(*seeds.shape, head_dim)

    def _encode(self, params: Params, x: jax.Array) -> Codes:
        head_dim = x.shape[-1]
        if params["rht_signs"].shape[-1] != head_dim:
            raise CodecError(f"{self.spec}: vectors of head_dim {head_dim} given to "
                             f"parameters made for head_dim {params['rht_signs'].shape[-1]}")
        plan = self.plan(head_dim)
        exact_norm = jnp.linalg.norm(x, axis=-1, keepdims=True)
        norm = stored_norm(x)
        unit = x / jnp.where(exact_norm > 0, exact_norm, 1.0)
        y = self._rotate(params, unit, plan.tile) * math.sqrt(head_dim)
        tokens = self.block_tokens
        lead = y.shape[:-2]
        nb = y.shape[-2] // tokens
        y = y.reshape(*lead, nb, tokens, head_dim)
        norm_blocks = norm.reshape(*lead, nb, tokens)
        u = self._dither(params, norm_blocks, head_dim) if self.dither else None
        lat = self.lat
        if self.int8:
            codes, _ = quantize_symbols(lat, plan.alpha * y, u)
            biased = jnp.clip(codes, -127, 127) + INT8_BIAS
            return {"codes": pack_codes(biased.reshape(*lead, nb * tokens, head_dim), 8),
                    "norm": norm.astype(jnp.float16)}
        elements = tokens * head_dim
        capacity = 32 * plan.words
        # a vector's squared error is |x|^2 / D times that of its y: blocks compare
        # candidates by their reconstruction error of x
        weight = jnp.square(norm_blocks)[..., None]
        levels, fits, errors = [], [], []
        for j in range(LADDER):
            alpha = plan.alpha * 2.0 ** (-j / 2)
            lattice_codes, symbols = quantize_symbols(lat, alpha * y, u)
            symbols = symbols.reshape(*lead, nb, elements)
            k1, k2, bits = block_payload(lat, symbols, plan.n_sub)
            levels.append((symbols, k1, k2))
            fits.append(bits <= capacity)
            if j:  # the calibrated scale is kept whenever it fits: no error needed
                y_hat = reconstruct(lat, lattice_codes, u) / alpha
                errors.append(_block_error(y, y_hat, weight))
        scale_codes = sign_scale_codes(y, plan.sign_scale_bits)
        y_sign = sign_scales(scale_codes, plan.sign_scale_bits)[..., None] * jnp.where(
            y >= 0, 1.0, -1.0)
        errors.append(_block_error(y, y_sign, weight))
        # a block that fits at the calibrated scale keeps it; one that does not takes the
        # candidate that reconstructs it best among the coarser scales that fit and the
        # signs (which always fit). A coarser scale is not always better than the signs:
        # a spike, rotated, is a flat vector that a coarse lattice rounds to zero.
        allowed = jnp.stack([*fits[1:], jnp.ones_like(fits[0])], axis=-1)
        fallback = 1 + jnp.argmin(jnp.where(allowed, jnp.stack(errors, -1), jnp.inf), -1)
        level = jnp.where(fits[0], 0, fallback).astype(jnp.int32)

        def pick(i):
            stacked = jnp.stack([lv[i] for lv in levels], axis=0)
            index = jnp.minimum(level, LADDER - 1)
            index = index.reshape(1, *index.shape, *([1] * (stacked.ndim - 1 - level.ndim)))
            return jnp.take_along_axis(stacked, index, axis=0)[0]

        symbols, k1, k2 = pick(0), pick(1), pick(2)
        streams = symbols.reshape(*lead, nb, plan.n_sub, plan.substream)
        classes = symbol_classes(lat, plan.substream)
        k = symbol_parameters(k1, k2, classes)
        words, offsets, _ = rice.encode(streams, k, plan.words)
        fallback = sign_words(y.reshape(*lead, nb, elements), scale_codes,
                              plan.sign_scale_bits, plan.words)
        use_signs = (level == SIGN_LEVEL)[..., None]
        words = jnp.where(use_signs, fallback, words)
        k1 = jnp.where(use_signs, 0, k1)
        k2 = jnp.where(use_signs, 0, k2)
        start = offsets.at[..., 0].set(level)
        index = (start.astype(jnp.uint32) | (k1.astype(jnp.uint32) << 24)
                 | (k2.astype(jnp.uint32) << 28))
        return {"stream": words, "index": index, "norm": norm_blocks.astype(jnp.float16)}

    def decode(self, params: Params, codes: Codes, dtype: Any = jnp.float32) -> jax.Array:
        """``|x| R^T (P - U) / (alpha_level sqrt(D))`` per token, cast to ``dtype``."""
        head_dim = params["rht_signs"].shape[-1]
        plan = self.plan(head_dim)
        lat = self.lat
        if self.int8:
            c = unpack_codes(codes["codes"], 8, head_dim).astype(jnp.int32) - INT8_BIAS
            lead = c.shape[:-2]
            norm = codes["norm"].astype(jnp.float32)
            u = (self._dither(params, norm.reshape(*lead, c.shape[-2], 1), head_dim)
                 .reshape(c.shape) if self.dither else None)
            pts = reconstruct(lat, c.reshape(*c.shape[:-1], head_dim // lat.dim, lat.dim), u)
            y = pts / (plan.alpha * math.sqrt(head_dim))
            return (norm * self._unrotate(params, y, plan.tile)).astype(dtype)
        norm = codes["norm"].astype(jnp.float32)
        u = self._dither(params, norm, head_dim) if self.dither else None
        y = rotated_tokens(self.rice_layout(head_dim), codes["stream"], codes["index"],
                           codes["norm"], u)
        x = self._unrotate(params, y, plan.tile)
        lead = x.shape[:-3]
        return x.reshape(*lead, -1, head_dim).astype(dtype)

    def rice_layout(self, head_dim: int) -> RiceLayout:
        """The static shape of this codec's Rice blocks at ``head_dim``
        (:class:`RiceLayout`)."""
        plan = self.plan(head_dim)
        return RiceLayout(lattice=self.lattice, head_dim=head_dim, block=self.block_tokens,
                          n_sub=plan.n_sub, substream=plan.substream, words=plan.words,
                          alpha=plan.alpha, sign_scale_bits=plan.sign_scale_bits)

    def bits_per_element(self, head_dim: int) -> float:
        """``32 (W + n_sub) / (tN D) + 16 / D``, or ``8 + 16 / D`` with int8."""
        self.check_head_dim(head_dim)
        if self.int8:
            return exact_bits(8 * head_dim + 16, head_dim)
        plan = self.plan(head_dim)
        elements = self.block_tokens * head_dim
        return exact_bits(32 * (plan.words + plan.n_sub) + 16 * self.block_tokens, elements)

    def kernel_formats(self) -> tuple[KernelFormat, ...]:
        """Without dither (drawn per token from a hash of the stored norms, it has no
        kernel format): ``int8``'s biased lattice codes as an
        :class:`~kvjax.codec.IntFormat` (scale: the norm; ``R``: :meth:`kernel_map`), the
        Rice blocks as a :class:`~kvjax.codec.RiceFormat`."""
        if self.dither:
            return ()
        if self.int8:
            return (IntFormat(bits=8, offset=INT8_BIAS, scale_key="norm",
                              rotate=self.kernel_map),)
        return (RiceFormat(layout=self.rice_layout, rotate=self.rotate_vectors,
                           unrotate=self.unrotate_vectors),)

    def rotate_vectors(self, params: Params, x: jax.Array) -> jax.Array:
        """The codec's rotation of vectors ``x[..., D]`` into its coding frame."""
        return self._rotate(params, x, self.tile or x.shape[-1])

    def unrotate_vectors(self, params: Params, y: jax.Array) -> jax.Array:
        """The inverse of :meth:`rotate_vectors`."""
        return self._unrotate(params, y, self.tile or y.shape[-1])

    def kernel_map(self, params: Params, x: jax.Array) -> jax.Array:
        """``R x`` for the int8 codes' :class:`~kvjax.codec.IntFormat`: a token decodes
        to ``|x| U (p * c) / (alpha sqrt D)`` (``U`` the inverse rotation, ``p`` the
        lattice's point scale per coordinate), so ``R = diag(p) U^T / (alpha sqrt D)``."""
        head_dim = x.shape[-1]
        plan = self.plan(head_dim)
        scale = np.tile(self.lat.point_scale, head_dim // self.lat.dim)
        return self._rotate(params, x, plan.tile) * (scale / (plan.alpha * math.sqrt(head_dim)))

    # -- diagnostics -------------------------------------------------------------------
    def fallback_levels(self, codes: Codes) -> jax.Array:
        """Per block: 0 at the calibrated scale, 1..3 a coarser one, 4 the sign fallback."""
        if self.int8:
            return jnp.zeros(codes["norm"].shape[:-1], jnp.int32)
        return (codes["index"][..., 0] & 0xFFFFFF).astype(jnp.int32)

    def fallback_blocks(self, codes: Codes) -> int:
        """How many blocks of ``codes`` did not fit their budget at the calibrated scale."""
        return int(jnp.sum(self.fallback_levels(codes) > 0))

    def payload_bits(self, codes: Codes) -> jax.Array:
        """Realized bits of each block's stream (int32 ``[..., nb]``), read from the words."""
        if self.int8:
            return jnp.full(codes["norm"].shape[:-1], 32 * codes["codes"].shape[-1], jnp.int32)
        return rice.used_bits(codes["stream"])


def _mix(bits: jax.Array) -> jax.Array:
    """A 32-bit hash of each row of ``bits[..., n]`` (uint32), order-sensitive."""
    h = jnp.full(bits.shape[:-1], 0x811C9DC5, jnp.uint32)
    for i in range(bits.shape[-1]):
        h = (h ^ bits[..., i]) * jnp.uint32(0x01000193)
        h = h ^ (h >> 15)
    return h


def _block_error(y: jax.Array, y_hat: jax.Array, weight: jax.Array) -> jax.Array:
    """``sum weight |y - y_hat|^2`` over each block's tokens and coordinates ``[..., nb]``."""
    return jnp.sum(weight * jnp.square(y - y_hat), axis=(-2, -1))


@functools.cache
def _plan(codec: HyperQuantCodec, head_dim: int) -> _Plan:
    # int8 stores the lattice points the default Rice stream would: same calibration
    tokens = DEFAULT_BLOCK_TOKENS if codec.int8 else codec.block_tokens
    cal = calibration(codec.lattice, head_dim, tokens, codec.dither)
    snr = cal.snr_for_rate(codec.rate)
    alpha = alpha_for_snr(codec.lat, snr)
    elements = codec.block_tokens * head_dim
    n_sub, size = substreams(elements, codec.lat.dim)
    budget = codec.rate * elements + codec.margin * cal.std_at(snr)
    words = max(math.ceil(budget / 32), -(-elements // 32))
    # the sign fallback's scales go in the words its signs leave free
    spare = 32 * (words - -(-elements // 32))
    return _Plan(alpha=alpha, snr_db=snr, words=words, n_sub=n_sub, substream=size,
                 tile=codec.tile or head_dim,
                 sign_scale_bits=min(SIGN_SCALE_BITS, spare // codec.block_tokens))
