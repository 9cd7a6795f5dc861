"""kvjax.eval.kernel_ops: operations per cached token counted from the traced kernels."""

import pytest

from kvjax.eval.kernel_ops import kernel_ops, ptx_instructions


def test_ptx_instructions_leave_out_declarations_and_braces():
    code = "{ .reg .b32 t, b; shr.b32 t, $1, 4; lop3.b32 t, t, 15, 0, 0xea; mov.b32 $0, t; }"
    assert ptx_instructions(code) == 3
    assert ptx_instructions("lop3.b32 $0, $1, 15, 0, 0xea;") == 1


def test_counts_follow_from_the_layouts():
    """Exact figures the layouts imply, per token and kv head at D = 128."""
    bf16 = kernel_ops("bf16")
    # every K and V element loaded once, no lookup, no gather
    assert bf16.kernel == "dense_decode" and bf16.ops["load"] == 2 * 128
    assert bf16.ops["lookup"] == bf16.ops["gather"] == 0
    int4 = kernel_ops("int:4")
    # per role 128 codes in four bit planes of two codes per 32-bit register: the low
    # two planes one lop3, the high two a shift and a lop3
    assert int4.kernel == "int_decode" and int4.ops["lookup"] == 2 * 128 * (1 + 1 + 2 + 2) / 8
    # scores and values: [rows, D] x [D, block] and [rows, block] x [block, D], 16 query
    # rows (the group of 4 padded) per program
    assert int4.mma == 2 * 16 * 128
    assert int4.block_s == 128


def test_a_kernel_that_gathers_says_so():
    hqmq = kernel_ops("hqmq:s96,r4")
    table = kernel_ops("hqmq:s96,r4", lookup="table")
    assert hqmq.kernel == "hqmq_decode" and hqmq.ops["gather"] > 0
    # the product form gathers as much as the table and computes more
    assert hqmq.ops["gather"] == table.ops["gather"] and hqmq.total > table.total
    # per chunk and role: four codeword components and the digit group's two bytes
    # (32 chunks, keys and values)
    assert hqmq.ops["gather"] == 2 * 32 * (4 + 2)
    # the digit groups as one load and a matmul: the two gathers per chunk go, and the
    # arithmetic that joined the bytes with them; a [block, 16] x [16, 32] product per role
    spread = kernel_ops("hqmq:s96,r4", digits="matmul")
    assert spread.ops["gather"] == 2 * 32 * 4 and spread.total < hqmq.total
    assert spread.mma - hqmq.mma == 2 * 16 * 32


def test_ordering_of_the_rotated_family_and_bad_specs():
    totals = {spec: kernel_ops(spec).total for spec in ("int:4", "turboquant:b4",
                                                        "octopus:b3")}
    assert totals["int:4"] < totals["turboquant:b4"] < totals["octopus:b3"]
    with pytest.raises(ValueError, match="no fused kernel reads"):
        kernel_ops("fp8")
