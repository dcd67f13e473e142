# SPDX-License-Identifier: Apache-2.0
"""The exact check's fingerprint (proof/fingerprint.py, exact_fingerprint): every
row index and every column index has a weight of its own, two elements
exchanged always change it, rows, columns and blocks of rows exchanged change
it, and the sums of shards and of stacked pieces add up to the whole's. On
CPU, with the torch code; test_direct_load runs the GPU kernel against it in
Triton's interpreter."""

import random

import pytest
import torch

from proof import fingerprint as d

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS[t.element_size()])


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(_bits(a), _bits(b))


def _random(shape, dtype, generator) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    return torch.randint(-3, 3, shape, generator=generator).to(dtype)  # few values: equal rows occur too


def _unmix30(y: torch.Tensor) -> torch.Tensor:
    """The inverse of fingerprint._mix30, step by step."""
    y = y ^ (y >> 15)
    y = (y * pow(0x297A2D39, -1, 1 << 30)) & d._MASK30
    y = y ^ (y >> 12) ^ (y >> 24)
    y = (y * pow(0x2C1B3C6D, -1, 1 << 30)) & d._MASK30
    return y ^ (y >> 15)


def test_every_row_and_column_index_below_the_limit_has_a_weight_of_its_own():
    """_weights is 2 * mix30(index + seed) + 1: mix30 undone by its inverse
    (so no two indices below 2**30 share a mix), odd weights below 2**31."""
    generator = torch.Generator().manual_seed(0)
    index = torch.cat(
        [
            torch.arange(1 << 20),
            torch.randint(0, 1 << 30, (1 << 20,), generator=generator),
            torch.arange((1 << 30) - 1024, 1 << 30),
        ]
    )
    mixed = d._mix30(index)
    assert int(mixed.min()) >= 0 and int(mixed.max()) < 1 << 30
    assert torch.equal(_unmix30(mixed), index)
    for seed in (d._ROW_SEED, d._COLUMN_SEED):
        weights = d._weights(index, seed)
        assert bool((weights % 2 == 1).all()) and int(weights.max()) < 1 << 31
        assert torch.equal(_unmix30((weights - 1) // 2), (index + seed) & d._MASK30)
        assert d._weights(torch.arange(1 << 20), seed).unique().numel() == 1 << 20


# Weights made odd by setting bit 0 of a 32-bit mix, mix32(index + seed) | 1,
# give two indices whose mixes differ in bit 0 alone one weight: below 151,936
# (a vocabulary's rows) one pair of rows and one pair of columns.
ODD_MIX32_ROWS, ODD_MIX32_COLUMNS = (48425, 54284), (69564, 80141)


def _odd_mix32(index: torch.Tensor, seed: int) -> torch.Tensor:
    return d._mix32((index + seed) & d._MASK32) | 1


def test_the_rows_and_columns_that_odd_mix32_weights_cannot_tell_apart_are_told_apart():
    indices = torch.arange(151_936)
    for seed, pair in ((d._ROW_SEED, ODD_MIX32_ROWS), (d._COLUMN_SEED, ODD_MIX32_COLUMNS)):
        weights = _odd_mix32(indices, seed)
        values, inverse, counts = torch.unique(weights, return_inverse=True, return_counts=True)
        shared = [tuple((inverse == k).nonzero().flatten().tolist()) for k in (counts > 1).nonzero().flatten()]
        assert shared == [pair]  # the only pair, and they share a weight there
    generator = torch.Generator().manual_seed(1)
    tall = _random((151_936, 2), torch.bfloat16, generator)
    swapped = tall.clone()
    swapped[list(ODD_MIX32_ROWS)] = tall[list(ODD_MIX32_ROWS[::-1])]
    assert not _same_bits(swapped, tall)
    before, after = d.exact_fingerprint(tall), d.exact_fingerprint(swapped)
    assert after[:2] == before[:2] and after[2] != before[2]
    wide = _random((2, 151_936), torch.bfloat16, generator)
    swapped = wide.clone()
    swapped[:, list(ODD_MIX32_COLUMNS)] = wide[:, list(ODD_MIX32_COLUMNS[::-1])]
    assert not _same_bits(swapped, wide)
    before, after = d.exact_fingerprint(wide), d.exact_fingerprint(swapped)
    assert after[0] == before[0] and after[1] != before[1]
    for seed, pair in ((d._ROW_SEED, ODD_MIX32_ROWS), (d._COLUMN_SEED, ODD_MIX32_COLUMNS)):
        assert d._weights(torch.tensor(pair), seed).unique().numel() == 2


# (shape, dtype, how many of each exchange): tall and thin as a vocabulary's
# rows, square-ish, 3-D (rows are the dims before the last), 1-D (one column),
# and integers of few values, where equal elements, rows and blocks occur.
CASES = [
    ((200_000, 2), torch.bfloat16, 3),
    ((151_936, 1), torch.float32, 3),
    ((3000, 17), torch.float32, 30),
    ((300, 64), torch.float8_e4m3fn, 30),
    ((12, 20, 33), torch.bfloat16, 30),
    ((5000,), torch.float16, 30),
    ((400, 3), torch.int32, 30),
    ((257, 2), torch.int8, 30),
    ((2, 300), torch.uint8, 30),
]


@pytest.mark.parametrize(("shape", "dtype", "count"), CASES, ids=[f"{s}-{t}".replace(" ", "") for s, t, _ in CASES])
def test_exchanged_elements_rows_columns_and_blocks_of_rows_change_the_fingerprint(shape, dtype, count):
    """Random exchanges in a random tensor, seen as the fingerprint sees it
    ([rows, last dim]): the fingerprint changes whenever the contents do,
    and stays when they do not; the sums that do not weigh what moved stay.
    Two elements: by_column if their columns differ, by_position if not
    (always: exact_fingerprint's argument); two rows and two blocks of rows:
    by_position; two columns: by_column, or by_position where the two hold
    the same values in another order."""
    generator = torch.Generator().manual_seed(hash((shape, str(dtype))) % (1 << 31))
    pick = random.Random(f"{shape}{dtype}")
    tensor = _random(shape, dtype, generator)
    grid = tensor.reshape(-1, d.columns_of(tensor))
    rows, columns = grid.shape
    before = d.exact_fingerprint(tensor)

    def exchanged(swap) -> tuple[bool, list[int]]:
        other = grid.clone()
        swap(other)
        return _same_bits(other, grid), d.exact_fingerprint(other.reshape(shape))

    def check(swap, weighs: int, what: str, changes: int | None = None) -> None:
        """`weighs`: the first sum that weighs the positions that moved; `changes`: the sum that must change."""
        same, after = exchanged(swap)
        if same:
            assert after == before, what
        else:
            assert after[:weighs] == before[:weighs], what
            assert after[weighs:] != before[weighs:] if changes is None else after[changes] != before[changes], what

    for _ in range(count):
        (i, a), (j, b) = [divmod(pick.randrange(rows * columns), columns) for _ in range(2)]

        def elements(t, i=i, a=a, j=j, b=b):
            t[i, a], t[j, b] = grid[j, b], grid[i, a]

        check(elements, 1 if a != b else 2, f"elements ({i}, {a}) and ({j}, {b})", 1 if a != b else 2)
        i, j = pick.sample(range(rows), 2)

        def two_rows(t, i=i, j=j):
            t[[i, j]] = grid[[j, i]]

        check(two_rows, 2, f"rows {i} and {j}", 2)
        length = pick.randint(1, rows // 2)
        first, second = sorted(pick.sample(range(rows - 2 * length + 2), 2))
        second += length - 1  # two blocks of `length` rows that do not overlap

        def blocks(t, first=first, second=second, length=length):
            t[first : first + length] = grid[second : second + length]
            t[second : second + length] = grid[first : first + length]

        check(blocks, 2, f"rows {first} and {second}, {length} each", 2)
        if columns > 1:
            a, b = pick.sample(range(columns), 2)

            def two_columns(t, a=a, b=b):
                t[:, [a, b]] = grid[:, [b, a]]

            check(two_columns, 1, f"columns {a} and {b}")


def test_the_sums_of_shards_and_of_stacked_pieces_add_up_to_the_wholes():
    """Pieces stacked on dim 0 (q/k/v into one parameter; each expert's
    tensor into a fused one), each fingerprinted at the row it lands at: all
    three sums add up to the stack's. At row 0 each, plain and by_column
    still do, by_position does not; k and v exchanged in the stack change
    by_position alone."""
    modulus = d.FINGERPRINT_MODULUS
    generator = torch.Generator().manual_seed(2)

    def added(parts) -> list[int]:
        sums = [d.fingerprint_sums(piece, at).tolist() for piece, at in parts]
        return [sum(column) % modulus for column in zip(*sums, strict=True)]

    q, k, v = (_random((n, 6), torch.bfloat16, generator) for n in (8, 4, 4))
    whole = d.exact_fingerprint(torch.cat([q, k, v]))
    assert added([(q, 0), (k, 8), (v, 12)]) == whole
    at_zero = added([(q, 0), (k, 0), (v, 0)])
    assert at_zero[:2] == whole[:2] and at_zero[2] != whole[2]
    exchanged = d.exact_fingerprint(torch.cat([q, v, k]))
    assert exchanged[:2] == whole[:2] and exchanged[2] != whole[2]
    experts = _random((4, 6, 5), torch.float32, generator)  # [E, 2I, H]: expert e's [2I, H] at row 6 * e
    assert added([(experts[e], 6 * e) for e in range(4)]) == d.exact_fingerprint(experts)
    shards = experts.chunk(3)  # FSDP2's split of dim 0: rows of dim 0, each [n, 6, 5]
    assert added([(s, 2 * n) for n, s in enumerate(shards)]) == d.exact_fingerprint(experts)


def test_a_tensor_with_rows_or_columns_beyond_the_weights_is_refused():
    """Rows and columns below 2**30 have a weight of their own; the
    fingerprint refuses a tensor (or a shard, at its row) that reaches past them."""
    limit = 1 << 30
    assert (
        d.fingerprint_sums(torch.ones(4, 3), limit - 4).tolist()
        == d.fingerprint_sums(torch.ones(4, 3), limit - 4).tolist()
    )
    with pytest.raises(ValueError, match="rows and columns below"):
        d.fingerprint_sums(torch.ones(4, 3), limit - 3)
    with pytest.raises(ValueError, match="rows and columns below"):
        d.fingerprint_sums(torch.empty(limit + 1, device="meta"))
    with pytest.raises(ValueError, match="rows and columns below"):
        d.fingerprint_sums(torch.empty(1, limit + 1, device="meta"))


def test_the_fingerprint_kernels_compile_for_a_gpu():
    """The kernels test_direct_load runs in Triton's interpreter compile for
    an H100/H200 (sm_90) without a GPU, for every element size, with the
    column weights and without (the interpreter does not check types as the
    compiler does)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    arguments = {"bits_ptr": "*i16", "partial_ptr": "*i64", "rows": "i32", "columns": "i32", "first_row": "i32"}
    constants = ("ELEMENT_BITS", "SALTED", "BLOCK_R", "BLOCK_C")
    for bits, salted in ((8, True), (16, True), (32, True), (16, False)):
        signature = {**arguments, "bits_ptr": f"*i{bits}", **dict.fromkeys(constants, "constexpr")}
        values = {"ELEMENT_BITS": bits, "SALTED": salted, "BLOCK_R": 2, "BLOCK_C": 4096}
        assert triton.compile(ASTSource(d._fingerprint_kernel, signature, values), target=target).asm["ptx"]
    signature = {"partial_ptr": "*i64", "sums_ptr": "*i64", "tiles": "i32", "BLOCK": "constexpr"}
    assert triton.compile(ASTSource(d._sum_partials_kernel, signature, {"BLOCK": 1024}), target=target).asm["ptx"]
