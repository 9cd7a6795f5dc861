"""What the tests of every kernel over rotated keys and group-wise INT values share
(:mod:`pallas_kernels.rotated`): their cases, the arrays the codecs really store for a
case, and the kernel suite over them (:class:`RotatedSuite`).

A kernel's test module subclasses :class:`RotatedSuite` with the suite's attributes
(:mod:`tests.pallas_kernels.suite`) and ``KEY_FORMAT``, the
:class:`~kvjax.codec.RotatedKeyFormat` its entry reads; a case's codes are those of its
cache spec's codecs, read through that format.

Tolerance: these kernels round their matmul operands (the rotated query, ``G q``, the
rebuilt unit vectors, the dequantized values, the probabilities) to float16 and
accumulate in float32, while the reference is exact float32; outputs here are O(1),
log-sum-exps of logits O(5) (:data:`TOLERANCE`, which a kernel may override).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.attention.fused import encoded_cache
from kvjax.codec import GroupIntFormat, RotatedKeyFormat
from kvjax.spec import parse_cache
from tests.pallas_kernels.suite import KernelSuite, PagedSuite, Shape


@dataclasses.dataclass(frozen=True)
class Case(Shape):
    """One call of the entry over a cache spec's codes."""

    spec: str
    lengths: tuple[int, ...]
    layers: int | None = None  # codes stacked over this many layers; layer 1 is read
    block_s: int | None = 16
    splits: int | None = 2

    @property
    def id(self) -> str:
        return "-".join(filter(None, [
            self.shape_id,
            self.spec.replace(":", "").replace(",", ""), f"bs{self.block_s}",
            f"sp{self.splits}", "n" + ",".join(map(str, self.lengths)),
            f"L{self.layers}" * bool(self.layers)]))


def formats(spec: str, key_format: type[RotatedKeyFormat]):
    """``(cache config, key format, value format)`` of a spec: the ``key_format`` its K
    codec offers and the group-wise INT format of its V codec."""
    config = parse_cache(spec)
    [k_fmt] = [f for f in config.k.kernel_formats() if isinstance(f, key_format)]
    [v_fmt] = [f for f in config.v.kernel_formats() if isinstance(f, GroupIntFormat)]
    return config, k_fmt, v_fmt


# One compiled program per shape and spec (the seed is traced): op-by-op dispatch would
# compile dozens of small programs, which costs more than the kernel.
@functools.partial(jax.jit, static_argnames=("spec", "batch", "heads", "group", "slots",
                                             "head_dim"))
def encoded(spec, batch, heads, group, slots, head_dim, seed=0):
    """``(q, key params, key codes, value codes)``: a normal query and random vectors
    encoded by the spec's codecs, one parameter draw per kv head (codes ``[B, K, S,
    ...]``)."""
    config = parse_cache(spec)
    keys = jax.random.split(jax.random.key(seed))
    q = jax.random.normal(keys[0], (batch, heads, group, head_dim))
    k_params, k_codes, _, v_codes = encoded_cache(config.k, config.v, batch=batch,
                                                  heads=heads, slots=slots,
                                                  head_dim=head_dim, key=keys[1])
    return q, k_params, k_codes, v_codes


@functools.partial(jax.jit, static_argnames=("spec",))
def codec_attention(spec, q, params, k_codes, v_codes, lengths):
    """The attention ``[B, K, G, D]`` of ``q`` over the first ``lengths[b]`` tokens: the
    codecs' own scores of the keys (``scores``: the decoded keys' dots, plus QJL's
    estimator) and decoded values, every product float32."""
    config = parse_cache(spec)
    s = jax.vmap(config.k.scores, in_axes=(0, 1, 1), out_axes=1)(params, q, k_codes)
    valid = jnp.arange(s.shape[-1])[None, :] < lengths[:, None]
    s = jnp.where(valid[:, None, None, :], s * q.shape[-1]**-0.5, -jnp.inf)
    values = config.v.decode(None, v_codes)
    return jnp.einsum("bkgs,bksd->bkgd", jax.nn.softmax(s, axis=-1), values,
                      precision="highest")


#: absolute tolerances of the normalized outputs and of the log-sum-exps
TOLERANCE = {"out": 3e-3, "lse": 2e-3}


class RotatedSuite(PagedSuite, KernelSuite):
    """The kernel suite over arrays the codecs of a case's spec really store: a
    subclass states ``KEY_FORMAT`` and the suite's attributes; ``encoded`` may be
    overridden to draw a case's vectors differently. Every kernel over rotated keys
    reads paged pools."""

    KEY_FORMAT: ClassVar[type[RotatedKeyFormat]]
    TOLERANCE: ClassVar[dict[str, float]] = TOLERANCE
    PAGED_ARRAYS: ClassVar[dict[str, int]] = {name: 1 for name in (
        "k_codes", "k_norm", "v_codes", "v_scale", "v_zero", "k_qjl", "k_residual_norm")}

    def encoded(self, case: Case, seed: int = 0):
        """``(q, key params, key codes, value codes)`` of the case's shape
        (:func:`encoded`)."""
        return encoded(case.spec, case.batch, case.heads, case.group, case.slots,
                       case.head_dim, seed)

    def coded(self, case: Case, seed: int = 0):
        """``(q, key arrays, value arrays, signs, sketch or None)``: the codes as the
        entry takes them."""
        q, params, k_codes, v_codes = self.encoded(case, seed)
        _, k_fmt, v_fmt = formats(case.spec, self.KEY_FORMAT)
        return (q, k_fmt.arrays(k_codes), v_fmt.arrays(v_codes), params["signs"],
                params.get("sketch"))

    def static(self, case: Case) -> dict:
        """The static arguments of the entry for the case: the keys' options, the
        values' width and group, ``sm_scale`` and the case's blocking."""
        _, k_fmt, v_fmt = formats(case.spec, self.KEY_FORMAT)
        return {**k_fmt.options(case.head_dim), "value_bits": v_fmt.bits,
                "value_group": v_fmt.group, "sm_scale": case.head_dim**-0.5,
                "block_s": case.block_s, "splits": case.splits}

    def inputs(self, case: Case) -> dict:
        q, k_arrays, v_arrays, signs, sketch = self.coded(case)
        layer = None
        if case.layers:
            # other layers hold other codes: reading the wrong one cannot pass
            stacks = [self.coded(case, seed) for seed in (1, 0, 2)[:case.layers]]
            k_arrays = [jnp.stack([s[1][i] for s in stacks]) for i in range(len(k_arrays))]
            v_arrays = [jnp.stack([s[2][i] for s in stacks]) for i in range(3)]
            layer = jnp.int32(1)
        k_codes, k_norm, *qjl = k_arrays
        return {"q": q, "k_codes": k_codes, "k_norm": k_norm,
                **dict(zip(("v_codes", "v_scale", "v_zero"), v_arrays, strict=True)),
                "lengths": jnp.asarray(case.lengths, jnp.int32), "layer": layer,
                "k_signs": signs, "k_qjl": qjl[0] if qjl else None,
                "k_residual_norm": qjl[1] if qjl else None, "qjl_sketch": sketch,
                **self.static(case)}

    def lengths(self, case: Case) -> list[int]:
        return list(case.lengths)

    def reference_and_codecs(self, case: Case) -> tuple[np.ndarray, np.ndarray]:
        """The reference's normalized output over the case's codes, and
        :func:`codec_attention` over the same codes."""
        o, _, l = self.reference(**self.inputs(case))
        q, params, k_codes, v_codes = self.encoded(case)
        # float32 products on a GPU too (its default rounds matmul operands)
        with jax.default_matmul_precision("highest"):
            want = codec_attention(case.spec, q, params, k_codes, v_codes,
                                   jnp.asarray(case.lengths))
        return np.asarray(o) / np.asarray(l)[..., None], np.asarray(want)
