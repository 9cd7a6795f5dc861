"""Partial softmaxes: the exact merge, the empty partial, normalizing, rotating back."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.partial import (
    NEG,
    dense_partial,
    empty_partial,
    merge_partials,
    normalize,
    unrotate_output,
)


def _case(n=37, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (2, 3, 4, 16))
    k = jax.random.normal(keys[1], (2, 3, n, 16)) * 3
    v = jax.random.normal(keys[2], (2, 3, n, 16))
    return q, k, v


def test_merging_the_parts_equals_the_whole():
    q, k, v = _case()
    valid = jnp.arange(37)[None, :] < jnp.array([37, 20])[:, None]
    whole = dense_partial(q, k, v, valid, sm_scale=0.3)
    cuts = [0, 5, 16, 30, 37]
    parts = [dense_partial(q, k[:, :, a:b], v[:, :, a:b], valid[:, a:b], sm_scale=0.3)
             for a, b in itertools.pairwise(cuts)]
    for merged in (merge_partials(parts),
                   merge_partials(tuple(jnp.stack(x, axis=2) for x in zip(*parts,
                                                                           strict=True)),
                                  axis=2)):
        np.testing.assert_allclose(normalize(*merged), normalize(*whole), atol=1e-6)
        np.testing.assert_allclose(merged[1] + jnp.log(merged[2]),
                                   whole[1] + jnp.log(whole[2]), atol=1e-5)
    # the softmax itself
    s = jnp.einsum("bkgd,bknd->bkgn", q, k, precision="highest") * 0.3
    p = jax.nn.softmax(jnp.where(valid[:, None, None], s, -jnp.inf), axis=-1)
    np.testing.assert_allclose(normalize(*whole),
                               jnp.einsum("bkgn,bknd->bkgd", p, v, precision="highest"),
                               atol=1e-5)


def test_merge_is_one_reduction():
    """The splits of a decode kernel merge in one reduction (one kernel per layer and
    step on a GPU), not a max and then the weighted sums."""
    q, k, v = _case()
    valid = jnp.ones((2, 37), bool)
    parts = tuple(jnp.stack(x, axis=2) for x in zip(*[
        dense_partial(q, k[:, :, a:a + 8], v[:, :, a:a + 8], valid[:, a:a + 8],
                      sm_scale=0.3) for a in (0, 8, 16, 24)], strict=True))
    text = str(jax.make_jaxpr(lambda p: normalize(*merge_partials(p, axis=2)))(parts))
    assert text.count("reduce") == 1 and "reduce_max" not in text


def test_an_empty_partial_is_absorbed_and_normalizes_to_zero():
    q, k, v = _case(n=9)
    valid = jnp.ones((2, 9), bool)
    part = dense_partial(q, k, v, valid, sm_scale=0.3)
    empty = empty_partial(q)
    assert float(jnp.max(empty[1])) == NEG and not np.any(np.asarray(empty[2]))
    for merged in (merge_partials([part, empty]), merge_partials([empty, part])):
        np.testing.assert_array_equal(normalize(*merged), normalize(*part))
    assert not np.any(np.asarray(normalize(*merge_partials([empty, empty]))))
    nothing = dense_partial(q, k, v, jnp.zeros((2, 9), bool), sm_scale=0.3)
    zero_tokens = dense_partial(q, k[:, :, :0], v[:, :, :0], valid[:, :0], sm_scale=0.3)
    for p in (nothing, zero_tokens):
        assert np.all(np.isfinite(np.asarray(normalize(*p))))
        assert not np.any(np.asarray(normalize(*p)))


def test_unrotate_output_inverts_a_rotation_of_the_values():
    q, k, v = _case(n=11)
    rotation = jnp.stack([jnp.linalg.qr(jax.random.normal(jax.random.key(h), (16, 16)))[0]
                          for h in range(3)])
    # R v per head, in full float32 (a GPU would otherwise use TF32)
    rotated_v = jnp.einsum("kde,bkne->bknd", rotation, v, precision=jax.lax.Precision.HIGHEST)
    valid = jnp.ones((2, 11), bool)
    o, m, l = dense_partial(q, k, rotated_v, valid, sm_scale=0.3)
    back = normalize(unrotate_output(o, rotation), m, l)
    np.testing.assert_allclose(back, normalize(*dense_partial(q, k, v, valid, sm_scale=0.3)),
                               atol=1e-5)
