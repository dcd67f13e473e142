# SPDX-License-Identifier: Apache-2.0
"""The exact check's fingerprint kernel on one GPU, without vLLM: per tensor
shape (two Moonlight expert tensors, one square), a device copy, the kernel
direct_load holds (`current_s`), a prototype of the one-mix kernel at several
tile sizes and warps (`light_*`), the same fused into a copy (`light_copy_s`),
and a plain sum (`sum_s`), each the mean of 10 after a warm-up. JSON to
./fp.json.

    python3 scripts/fingerprint_kernel_bench.py
"""

import json
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, ".")
from proof import fingerprint as dl


def bench(fn, n=10):
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Event(enable_timing=True)
    e = torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / n / 1e3


_m = dl._mix32_triton  # the fingerprint's own 32-bit mix


@triton.jit
def light(
    bits_ptr, dst_ptr, partial_ptr, rows, columns, COPY: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
    column = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    inside = (row < rows) & (column < columns)
    raw = tl.load(bits_ptr + row * columns + column, mask=inside, other=0)
    if COPY:
        tl.store(dst_ptr + row * columns + column, raw, mask=inside)
    bits = raw.to(tl.uint16, bitcast=True).to(tl.uint32) ^ 0x5BD1E995
    plain = _m(bits)
    colm = _m(column.to(tl.uint32) + 0x9E3779B9) | 1
    rowm = _m(row.to(tl.uint32) + 0x27D4EB2F) | 1
    byc = plain * colm
    byp = byc * rowm
    zero = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.int64)
    at = partial_ptr + (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * 3
    tl.store(at + 0, tl.sum(tl.sum(tl.where(inside, plain.to(tl.int64), zero), axis=1), axis=0))
    tl.store(at + 1, tl.sum(tl.sum(tl.where(inside, byc.to(tl.int64), zero), axis=1), axis=0))
    tl.store(at + 2, tl.sum(tl.sum(tl.where(inside, byp.to(tl.int64), zero), axis=1), axis=0))


def run_light(t, dst=None, block=4096, warps=4):
    cols = t.shape[-1]
    rows = t.numel() // cols
    bc = min(triton.next_power_of_2(cols), block)
    br = block // bc
    grid = (triton.cdiv(rows, br), triton.cdiv(cols, bc))
    partial = torch.empty(grid[0] * grid[1], 3, dtype=torch.int64, device=t.device)
    bits = t.view(torch.int16)
    light[grid](
        bits,
        dst.view(torch.int16) if dst is not None else bits,
        partial,
        rows,
        cols,
        COPY=dst is not None,
        BLOCK_R=br,
        BLOCK_C=bc,
        num_warps=warps,
    )
    return partial.sum(0)


out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
for shape in [(64, 2816, 2048), (64, 2048, 1408), (8192, 4096)]:
    t = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    d = torch.empty_like(t)
    gb = t.numel() * 2 / 1e9
    r = {"gb": gb}
    r["copy_s"] = bench(lambda: d.copy_(t))
    r["current_s"] = bench(lambda: dl.fingerprint_sums_triton(t))
    for block in (2048, 4096, 8192):
        for warps in (4, 8):
            r[f"light_b{block}_w{warps}_s"] = bench(lambda: run_light(t, None, block, warps))
    r["light_copy_s"] = bench(lambda: run_light(t, d, 4096, 8))
    assert torch.equal(d, t)
    r["sum_s"] = bench(lambda: t.sum())
    out[str(shape)] = r
    print(shape, json.dumps(r), flush=True)

json.dump(out, open("fp.json", "w"), indent=1)
