"""The registered attention implementations, one line each; ``"auto"`` tries the fused
kernels first (registration order), then ``"xla"``, then ``"reference"`` on a GPU.

A new kernel: a folder in :mod:`pallas_kernels` with its array-level entry, and one
line here (for a kernel over :class:`~kvjax.codec.IntFormat` codes,
:func:`~kvjax.attention.fused.int_codes_kernel`; over rotated keys and group-wise INT
values, :func:`~kvjax.attention.fused.rotated_kernel` with its key format; over HQMQ
codes, :func:`~kvjax.attention.fused.hqmq_kernel`; over Rice-coded HyperQuant blocks,
:func:`~kvjax.attention.fused.rice_kernel`; over values stored as they are,
:func:`~kvjax.attention.fused.dense_kernel`). ``"chunk_flash"`` (:mod:`.prefill`)
serves chunks of several tokens, the prefill's.
"""

from __future__ import annotations

import kvjax.attention.prefill as prefill
import kvjax.attention.reference as reference
import kvjax.attention.xla as xla
import pallas_kernels.codebook_decode.api as codebook_decode
import pallas_kernels.dense_decode.api as dense_decode
import pallas_kernels.hqmq_decode.api as hqmq_decode
import pallas_kernels.int_decode.api as int_decode
import pallas_kernels.octopus_decode.api as octopus_decode
import pallas_kernels.polar_decode.api as polar_decode
import pallas_kernels.rice_decode.api as rice_decode
from kvjax.attention.dispatch import Impl, register
from kvjax.attention.fused import (
    dense_kernel,
    hqmq_kernel,
    int_codes_kernel,
    rice_kernel,
    rotated_kernel,
)
from kvjax.codec import CodebookFormat, OctopusFormat, PolarFormat

register(Impl(name="reference", supports=reference.supports, run=reference.run))
register(Impl(name="xla", supports=xla.supports, run=xla.run))
register(int_codes_kernel("int_decode", int_decode.int_decode, int_decode.unsupported))
register(rotated_kernel("codebook_decode", codebook_decode.codebook_decode, CodebookFormat,
                        codebook_decode.unsupported))
register(rotated_kernel("octopus_decode", octopus_decode.octopus_decode, OctopusFormat,
                        octopus_decode.unsupported))
register(rotated_kernel("polar_decode", polar_decode.polar_decode, PolarFormat,
                        polar_decode.unsupported))
register(hqmq_kernel("hqmq_decode", hqmq_decode.hqmq_decode, hqmq_decode.unsupported))
register(rice_kernel("rice_decode", rice_decode.rice_decode, rice_decode.unsupported))
# chunks over a 16-bit cache read in place, before "dense_decode" (which serves them too,
# and a raw window beside them): 8 x 32k tokens prefill in 15.2 s against "xla"'s 31.2 s
# (docs/kernels.md)
register(Impl(name="chunk_flash", supports=prefill.supports, run=prefill.run, fused=True))
# before "xla": in the models' loop a bf16 cache's layer is a slice of its stack, which
# cuDNN needs copied (B=8, S=32k: 13.7 ms per step against 29.4, docs/kernels.md)
register(dense_kernel("dense_decode", dense_decode.dense_decode, dense_decode.unsupported))
