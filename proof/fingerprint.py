# SPDX-License-Identifier: Apache-2.0
"""The exact check's fingerprint: three exact int64 sums of a tensor's elements, on any device.

exact_fingerprint says what the sums are and what they guarantee. The trainer ranks and the engines both use
them (proof/rank_measurement.py, proof/exact_check_engine.py); on a GPU one Triton kernel computes them.
"""

from __future__ import annotations

import math

import torch

try:  # vLLM's GPU builds depend on Triton; without it, the torch code fingerprints everything.
    import triton
    import triton.language as tl
except ImportError:
    triton = None

FINGERPRINT_CHUNK = 1 << 24  # Elements per step of the torch code, to bound the temporary memory.


# The exact check's fingerprint; exact_fingerprint says what it is and what it guarantees.
# It is three sums of each element's mixed bits: `plain`, which does not depend on where an
# element sits; `by_column`, weighted by its column; and `by_position`, weighted by its column
# and its row. The arithmetic is exact in int64, so the trainer's GPU, an engine's GPU and a
# CPU give the same sums.
FINGERPRINT_MODULUS = 1 << 62
_INDEX_LIMIT = 1 << 30  # Every row and column index below this has a weight of its own.
_MASK30, _MASK31, _MASK32, _MASK62 = _INDEX_LIMIT - 1, (1 << 31) - 1, (1 << 32) - 1, FINGERPRINT_MODULUS - 1
_COLUMN_SEED, _ROW_SEED = 0x9E3779B9, 0x27D4EB2F


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """Apply lowbias32, a bijection, to int64 values below 2**32; products wrap, but the low 32 bits are exact."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def _mix30(x: torch.Tensor) -> torch.Tensor:
    """Mix int64 values below 2**30 with a bijection.

    Each step is invertible: an xor with the value shifted right, or a product by an odd number modulo 2**30.
    """
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _MASK30
    x = x ^ (x >> 12)
    x = (x * 0x297A2D39) & _MASK30
    return x ^ (x >> 15)


def _weights(index: torch.Tensor, seed: int) -> torch.Tensor:
    """Return the weight of each row or column `index`, int64 below 2**30.

    The weight is 2 * mix30((index + seed) mod 2**30) + 1: odd, below 2**31, and different for every index,
    because index -> (index + seed) mod 2**30 and mix30 are both bijections of the integers below 2**30.
    """
    return _mix30((index.to(torch.int64) + seed) & _MASK30) * 2 + 1


def _times62(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Return a * w modulo 2**62 exactly, for int64 a below 2**62 and w below 2**31.

    `a` is split at bit 31, so each partial product is below 2**62 and their sum below 2**63.
    """
    return (((((a >> 31) * w) & _MASK31) << 31) + (a & _MASK31) * w) & _MASK62


def _sum62(a: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Return the sum of `a` along `dim`, or over all of it if None, modulo 2**62 exactly.

    Each value is int64 below 2**63, with at most 2**31 of them summed. The bits above 31 and those below are
    summed apart, so each sum stays below 2**63.
    """
    high, low = (a >> 31).sum(dim), (a & _MASK31).sum(dim)
    return (((high & _MASK31) << 31) + (low & _MASK62)) & _MASK62


def exact_fingerprints(tensors) -> list[list[int]]:
    """Return exact_fingerprint of each tensor, waiting for the device once."""
    sums = exact_fingerprint_sums(tensors)
    return torch.stack(sums).cpu().tolist() if sums else []


class HeldFingerprints:
    """Compute exact_fingerprints of tensors that stay in place between syncs, from one CUDA graph.

    The tensors are an engine's or a trainer's parameters. A model of hundreds of tensors spends more time
    launching the few small kernels each one needs than the GPU spends in them, so a graph replays every
    launch at once. The graph reads the tensors where they were when it was captured. It is captured once the
    same tensors at the same addresses come twice in a row, and captured again once moved tensors come twice
    in a row; a loader that allocates new tensors each time is fingerprinted eagerly.

    Each tensor may be cast first, through the dtypes in `casts` in order, and may be a shard starting at a
    row of a larger tensor, per `row_offsets`; see fingerprint_sums. A call with a tensor that needs a cast
    or a contiguous copy runs eagerly, because a graph would keep those copies' memory for as long as it
    lives. `start` runs the kernels on their own CUDA stream, beside whatever the process does next, and
    returns a function that waits for them.
    """

    def __init__(self) -> None:
        self._last = None  # The previous call's tensors, as (address, shape, stride, dtype, offset) each.
        self._graph = self._sums = self._stream = None

    def __call__(self, tensors, row_offsets=None, casts=None) -> list[list[int]]:
        return self.start(tensors, row_offsets, casts)()

    def start(self, tensors, row_offsets=None, casts=None):
        """Launch the fingerprints; return a function that waits for them and reads them back."""
        tensors = list(tensors)
        row_offsets = list(row_offsets or [0] * len(tensors))
        casts = [tuple(c) for c in (casts or [()] * len(tensors))]

        def sums() -> torch.Tensor:
            out = []
            for tensor, offset, dtypes in zip(tensors, row_offsets, casts, strict=True):
                for dtype in dtypes:
                    tensor = tensor.to(dtype)
                out.append(fingerprint_sums(tensor, offset))
            return torch.stack(out)

        if not tensors or not all(t.is_cuda for t in tensors):
            done = sums().tolist() if tensors else []
            return lambda: done
        graphed = not any(casts) and all(t.is_contiguous() for t in tensors)
        key = (
            [(t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, o) for t, o in zip(tensors, row_offsets, strict=True)]
            if graphed
            else None
        )
        self._stream = self._stream or torch.cuda.Stream(tensors[0].device)
        if key is None or key != self._last:  # New tensors, or ones a graph should not hold: run eagerly.
            self._last, self._graph, self._sums = key, None, None
        elif self._graph is None:  # The same tensors a second time: capture.
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            # Not torch.cuda.graph(): it empties PyTorch's cache first, and the
            # trainer would allocate its 4 GiB send buffer again next sync.
            # "thread_local" because vLLM's own threads may use CUDA meanwhile.
            with torch.cuda.stream(self._stream):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    captured = sums()
                finally:
                    graph.capture_end()
            self._graph, self._sums = graph, captured
        self._stream.wait_stream(torch.cuda.current_stream(tensors[0].device))  # Wait for what wrote them.
        with torch.cuda.stream(self._stream):
            if self._graph is not None:
                self._graph.replay()
                out = self._sums
            else:
                out = sums()
            ready = torch.cuda.Event()
            ready.record(self._stream)

        def result() -> list[list[int]]:
            ready.synchronize()
            return out.cpu().tolist()

        return result


def exact_fingerprint_sums(tensors) -> list[torch.Tensor]:
    """Return exact_fingerprint of each tensor as an int64 tensor of 3 on its device, without waiting."""
    return [fingerprint_sums(t) for t in tensors]


def exact_fingerprint(tensor: torch.Tensor) -> list[int]:
    """Return [plain, by_column, by_position] of a tensor's elements, each modulo FINGERPRINT_MODULUS, 2**62.

    The tensor is seen as [rows, columns]. Its columns are its last dim, or one column for a 1-D tensor, and
    its rows are all the dims before. Rows are counted from the first row of the whole tensor that a shard or
    a piece is part of; see `row_offset` of fingerprint_sums. Each element's bits go through lowbias32, a
    bijection of 32-bit integers; an 8-byte element's bits are first folded to 32. So
    m = mix32(bits ^ 0x5BD1E995) is below 2**32 and different for different bits. Then, modulo 2**62:

        plain       = sum of m
        by_column   = sum of m * cw(column)
        by_position = sum of m * cw(column) * rw(row)

    cw and rw come from _weights, each with its own seed, and cw = 1 for a tensor of one column. The weight
    is w(i) = 2 * mix30((i + seed) mod 2**30) + 1, where mix30 is a bijection of the integers below 2**30,
    so every row index and every column index below 2**30 has an odd weight below 2**31 of its own. A tensor
    with more rows or columns is refused. Every intermediate stays below 2**63, through m * cw, _times62 and
    _sum62, so the arithmetic is exact on any device, with no overflow.

    What it guarantees:

    - Sums add up. An element's three terms depend only on its bits, its column and its row in the whole.
      So the sums of shards, each a block of dim-0 rows at its row_offset, and of pieces stacked on dim 0,
      each at the rows it lands at, add up modulo 2**62 to the whole's, for all three sums. plain and
      by_column do not depend on the row, so the pieces' sums add up to the stack's wherever they land.

    - Exchanging two elements with different bits always changes a sum. Say u sits at (i, a) and v at
      (j, b), with m(u) != m(v). For a != b, by_column changes by (cw(a) - cw(b)) * (m(v) - m(u)).
      cw(a) - cw(b) is twice the difference of two distinct mix30 values below 2**30, so it is nonzero with
      at most 1 + 29 factors of 2. m(v) - m(u) is nonzero and smaller than 2**32 in size, so it has at most
      31. The product has at most 61, so it is no multiple of 2**62. For a == b, so i != j, by_position
      changes by cw(a) * (rw(i) - rw(j)) * (m(v) - m(u)) with cw(a) odd, and the same argument holds.
      Likewise, exchanging two rows that differ in one element changes by_position, and exchanging two
      columns that differ in one element changes by_column.

    - Other rearrangements can go unseen, with small probability. Exchanging two rows or columns that differ
      in several elements, exchanging blocks of rows, or transposing changes a sum by many such products
      added up, and those can cancel modulo 2**62. With fixed constants this is a checksum, not a
      cryptographic hash: data crafted against them can cancel. For other data, take the mixes of different
      bit patterns as independent uniform 32-bit values. The change is a sum over the bit patterns of
      A * m(pattern), where A is the pattern's weights where it is now minus its weights where it was. If
      some A is not a multiple of 2**62, say it has t factors of 2, then given the other mixes, at most
      max(1, 2**(t - 30)) of the 2**32 values of that pattern's mix make the change vanish. That is a chance
      of at most 2**-min(32, 62 - t). A pattern that one row holds once and the other not at all has t <= 30.

    - It compares bits. +0.0 and -0.0 differ, as do two NaNs with different payloads. Two 8-byte elements
      whose bits fold to the same 32 bits do not differ.
    """
    return fingerprint_sums(tensor).tolist()


@torch.no_grad()
def fingerprint_sums(tensor: torch.Tensor, row_offset: int = 0) -> torch.Tensor:
    """Return exact_fingerprint as an int64 tensor of 3 on the tensor's device.

    On a GPU, 1-, 2- and 4-byte elements take one pass of one kernel, _fingerprint_kernel; otherwise torch
    computes it in pieces of bounded size. `row_offset` is the dim-0 row where this tensor starts in the
    tensor it is a shard of, so that the shards' sums add up to the whole's.
    """
    if triton is not None and tensor.is_cuda and tensor.element_size() in (1, 2, 4) and tensor.numel():
        return fingerprint_sums_triton(tensor, row_offset=row_offset)
    flat = tensor.detach()
    columns = columns_of(flat)
    rows = flat.contiguous().reshape(-1, columns)
    first_row = _first_row(tensor, row_offset, rows.shape[0])
    bits_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[rows.element_size()]
    unsigned = (1 << (8 * rows.element_size())) - 1 if rows.element_size() < 8 else -1
    column_weight = _weights(torch.arange(columns, device=rows.device), _COLUMN_SEED) if columns > 1 else 1
    sums = torch.zeros(3, dtype=torch.int64, device=rows.device)
    step = max(1, FINGERPRINT_CHUNK // columns)
    for start in range(0, rows.shape[0], step):
        bits = rows[start : start + step].view(bits_dtype).to(torch.int64) & unsigned
        if rows.element_size() == 8:  # Fold 64-bit patterns into 32.
            bits = (bits ^ (bits >> 32)) & _MASK32
        plain = _mix32(bits ^ 0x5BD1E995)  # The constant makes zeros count too.
        by_column = plain * column_weight  # Below 2**32 * 2**31.
        first = first_row + start
        row_weight = _weights(torch.arange(first, first + bits.shape[0], device=rows.device), _ROW_SEED)
        row_sums = _sum62(by_column, 1)  # Each row's by_column; its by_position is that times the row's weight.
        sums[0] = (sums[0] + plain.sum()) & _MASK62
        sums[1] = (sums[1] + _sum62(row_sums)) & _MASK62
        sums[2] = (sums[2] + _sum62(_times62(row_sums, row_weight))) & _MASK62
    return sums


def _first_row(tensor: torch.Tensor, row_offset: int, rows: int | None = None) -> int:
    """Return the fingerprint row of the first element of a shard that starts at `row_offset` on dim 0.

    The fingerprint sees the tensor as [rows, columns]. If the shard's `rows` is given, raise if a row or a
    column would have no weight of its own.
    """
    first = row_offset * math.prod(tensor.shape[1:-1]) if tensor.dim() >= 2 else row_offset
    if rows is not None and not (0 <= first and first + rows <= _INDEX_LIMIT and columns_of(tensor) <= _INDEX_LIMIT):
        raise ValueError(
            f"cannot fingerprint a tensor of shape {tuple(tensor.shape)} at row {first}: the fingerprint "
            f"tells apart rows and columns below {_INDEX_LIMIT}"
        )
    return first


def columns_of(tensor: torch.Tensor) -> int:
    """Return the fingerprint's column count: the last dim's size, or 1 for a 1-D or empty-last-dim tensor."""
    return tensor.shape[-1] if tensor.dim() >= 2 and tensor.shape[-1] > 0 else 1


def fingerprint_sums_triton(tensor: torch.Tensor, block: int = 8192, row_offset: int = 0) -> torch.Tensor:
    """Compute fingerprint_sums in one pass of a Triton kernel, reading the tensor once.

    Each program mixes a tile of `block` elements, a power of 2, of the tensor seen as [rows, columns], with
    the torch code's arithmetic, and writes its three partial sums, each below 2**62. A second kernel adds
    those up. A 2-D grid gives each element its row and column without a division. On CPU it runs only under
    TRITON_INTERPRET=1, which is how the tests check it against the torch code.
    """
    flat = tensor.detach().contiguous().reshape(-1)
    columns = columns_of(tensor)
    rows = flat.numel() // columns
    first_row = _first_row(tensor, row_offset, rows)
    bits = flat.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[flat.element_size()])
    block_c = min(triton.next_power_of_2(columns), block)
    block_r = block // block_c
    grid = (triton.cdiv(rows, block_r), triton.cdiv(columns, block_c))
    partial = torch.empty(grid[0] * grid[1], 3, dtype=torch.int64, device=flat.device)
    _fingerprint_kernel[grid](
        bits,
        partial,
        rows,
        columns,
        first_row,
        ELEMENT_BITS=8 * flat.element_size(),
        SALTED=columns > 1,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
    )
    sums = torch.empty(3, dtype=torch.int64, device=flat.device)
    _sum_partials_kernel[(3,)](partial, sums, partial.shape[0], BLOCK=1024)
    return sums


# The kernel's arithmetic is the torch code's, step for step: _mix32, _mix30,
# _weights, _times62 and _sum62 each have a twin here that computes the same
# values. The twins use uint32 where the torch code masks to 32 or 30 bits,
# because wrapping modulo 2**32 gives the same low bits, and int64 elsewhere.
if triton is not None:

    @triton.jit
    def _mix32_triton(x):  # _mix32 on uint32; its products wrap as `& _MASK32` does in _mix32.
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x846CA68B
        return x ^ (x >> 16)

    @triton.jit
    def _mix30_triton(x):  # _mix30 on uint32 below 2**30: a product modulo 2**32, then masked to 30 bits.
        x = x ^ (x >> 15)
        x = (x * 0x2C1B3C6D) & 0x3FFFFFFF
        x = x ^ (x >> 12)
        x = (x * 0x297A2D39) & 0x3FFFFFFF
        return x ^ (x >> 15)

    @triton.jit
    def _weights_triton(index, seed):  # _weights as uint32, below 2**31.
        return _mix30_triton((index.to(tl.uint32) + seed) & 0x3FFFFFFF) * 2 + 1

    @triton.jit
    def _times62_triton(a, w):  # _times62: int64 a below 2**62, int64 w below 2**31
        return (((((a >> 31) * w) & 0x7FFFFFFF) << 31) + (a & 0x7FFFFFFF) * w) & 0x3FFFFFFFFFFFFFFF

    @triton.jit
    def _sum62_triton(a, axis):  # _sum62 along `axis`
        high = tl.sum(a >> 31, axis=axis)
        low = tl.sum(a & 0x7FFFFFFF, axis=axis)
        return (((high & 0x7FFFFFFF) << 31) + (low & 0x3FFFFFFFFFFFFFFF)) & 0x3FFFFFFFFFFFFFFF

    @triton.jit
    def _fingerprint_kernel(
        bits_ptr,
        partial_ptr,
        rows,
        columns,
        first_row,
        ELEMENT_BITS: tl.constexpr,
        SALTED: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        column = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
        inside = (row[:, None] < rows) & (column[None, :] < columns)
        raw = tl.load(bits_ptr + row[:, None] * columns + column[None, :], mask=inside, other=0)
        if ELEMENT_BITS == 8:
            bits = raw.to(tl.uint8, bitcast=True).to(tl.uint32)
        elif ELEMENT_BITS == 16:
            bits = raw.to(tl.uint16, bitcast=True).to(tl.uint32)
        else:
            bits = raw.to(tl.uint32, bitcast=True)
        plain = _mix32_triton(bits ^ 0x5BD1E995)
        if SALTED:
            column_weight = _weights_triton(column, 0x9E3779B9)
        else:
            column_weight = tl.full([BLOCK_C], 1, dtype=tl.uint32)
        zero = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.int64)
        by_column = tl.where(inside, plain.to(tl.int64) * column_weight.to(tl.int64)[None, :], zero)
        row_weight = _weights_triton(row + first_row, 0x27D4EB2F).to(tl.int64)
        row_sums = _sum62_triton(by_column, 1)  # This tile's part of each row's by_column.
        at = partial_ptr + (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * 3
        tl.store(at + 0, tl.sum(tl.sum(tl.where(inside, plain.to(tl.int64), zero), axis=1), axis=0))
        tl.store(at + 1, _sum62_triton(row_sums, 0))
        tl.store(at + 2, _sum62_triton(_times62_triton(row_sums, row_weight), 0))

    @triton.jit
    def _sum_partials_kernel(partial_ptr, sums_ptr, tiles, BLOCK: tl.constexpr):
        """Sum column k of `partial`, [tiles, 3] with each value below 2**62, modulo 2**62 in program k.

        This adds up the tiles as the torch code adds up its chunks' sums.
        """
        k = tl.program_id(0)
        total = tl.zeros([BLOCK], dtype=tl.int64)  # Each lane's share, below 2**62.
        for start in range(0, tiles, BLOCK):
            tile = start + tl.arange(0, BLOCK)
            total = (total + tl.load(partial_ptr + tile * 3 + k, mask=tile < tiles, other=0)) & 0x3FFFFFFFFFFFFFFF
        tl.store(sums_ptr + k, _sum62_triton(total, 0))
