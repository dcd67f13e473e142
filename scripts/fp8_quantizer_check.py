# SPDX-License-Identifier: Apache-2.0
"""On a GPU: the direct loader's FP8 quantizer (fp8_experts.fp8_quantize_blocks,
one Triton kernel) against vLLM's own per-block quantization
(fp8_experts.fp8_reference, through vllm.utils.deep_gemm.per_block_cast_to_fp8),
bit for bit, on expert blocks of the presets' shapes (padded and not) filled
with normal values, with zeros, with values too small for e4m3's normal range,
with a few large outliers, and on fp8_experts.fp8_every_case_block (every
case of the arithmetic, up to sign and powers of two); and the time of each: the kernel where the
engine quantizes as it writes (the direct loader; and each of its variants: the GPU's own e4m3 cast or the
written-out one, 4, 8 or 16 warps), vLLM's function, the bf16
copy the sync makes otherwise, and quantizing on the trainer's side instead
(the kernel into the send's buffer, then the engine's copy of the FP8 bytes
and scales; fewer bytes through IPC, one more pass over them).

    python scripts/fp8_quantizer_check.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from weight_sync import fp8_experts  # noqa: E402

SHAPES = {  # name: (experts, shards x rows, columns), shards
    "moonlight w13": ((64, 2 * 1408, 2048), 2),
    "moonlight w2": ((64, 2048, 1408), 1),
    "tiny w13 (padded)": ((8, 2 * 64, 128), 2),
    "tiny w2 (padded)": ((8, 128, 64), 1),
    "odd (padded both ways)": ((3, 2 * 200, 300), 2),
}


def fills(shape, generator):
    normal = torch.randn(shape, generator=generator, device="cuda") * 0.02
    outliers = normal.clone()
    outliers.view(-1)[::9973] = 30.0
    yield "normal", normal
    yield "zeros", torch.zeros(shape, device="cuda")
    yield "subnormal range", normal * 1e-6
    yield "outliers", outliers
    yield "mixed scales", normal * torch.logspace(-8, 2, shape[-1], device="cuda")


def timed(fn, repeats=5) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def variants(block, shards, want) -> list[dict]:
    """The kernel with the GPU's own e4m3 cast or the written-out one, at each thread count: whether its bytes
    are vLLM's, and its time against the bf16 copy of the same block."""
    rows = []
    for native in (False, True):
        for num_warps in (4, 8, 16):
            got = (torch.empty_like(want[0]), torch.empty_like(want[1]))

            def launch(got=got, native=native, num_warps=num_warps):
                fp8_experts._launch_fp8_blocks(block, shards, *got, native=native, num_warps=num_warps)

            seconds = timed(launch, repeats=20)
            rows.append(
                {
                    "native": native,
                    "num_warps": num_warps,
                    "identical": fp8_experts._same_bytes(got, want),
                    "kernel_s": seconds,
                }
            )
    return rows


def compared(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> dict:
    """(FP8 weight, fp32 scales) pairs compared byte for byte: whether each is identical, and how many
    of its elements differ."""
    weight_bytes, want_weight_bytes = got[0].view(torch.uint8), want[0].view(torch.uint8)
    scale_bits, want_scale_bits = got[1].view(torch.int32), want[1].view(torch.int32)
    return {
        "weight_identical": torch.equal(weight_bytes, want_weight_bytes),
        "scales_identical": torch.equal(scale_bits, want_scale_bits),
        "weight_bytes_differing": int((weight_bytes != want_weight_bytes).sum()),
        "scales_differing": int((scale_bits != want_scale_bits).sum()),
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    args = p.parse_args()
    generator = torch.Generator(device="cuda").manual_seed(0)
    results, failures = [], 0
    for name, (shape, shards) in SHAPES.items():
        for fill, values in fills(shape, generator):
            block = values.to(torch.bfloat16)
            want_w, want_s = fp8_experts.fp8_reference(block, shards)
            got_w, got_s = torch.empty_like(want_w), torch.empty_like(want_s)
            fp8_experts._launch_fp8_blocks(block, shards, got_w, got_s)  # the kernel alone (no first-block check)
            other_w, other_s = torch.empty_like(want_w), torch.empty_like(want_s)  # the scale as amax / 448
            fp8_experts._launch_fp8_blocks(block, shards, other_w, other_s, divide=True)
            row = {
                "shape": name,
                "fill": fill,
                **compared((got_w, got_s), (want_w, want_s)),
                "dividing_kernel_identical": fp8_experts._same_bytes((other_w, other_s), (want_w, want_s)),
            }
            if fill == "normal":
                row["kernel_s"] = timed(lambda: fp8_experts._launch_fp8_blocks(block, shards, got_w, got_s))
                row["vllm_function_s"] = timed(lambda: fp8_experts.fp8_reference(block, shards))
                copy = torch.empty_like(block)
                row["copy_bf16_s"] = timed(lambda: copy.copy_(block))  # the bf16 sync's copy of the same block

                def trainer_side():  # the trainer quantizes into its send buffer, the engine copies FP8 bytes and scales
                    fp8_experts._launch_fp8_blocks(block, shards, other_w, other_s)
                    got_w.copy_(other_w)
                    got_s.copy_(other_s)

                row["trainer_side_s"] = timed(trainer_side)
                row["kernel_variants"] = variants(block, shards, (want_w, want_s))
            failures += not (row["weight_identical"] and row["scales_identical"])
            results.append(row)
            print(json.dumps(row), flush=True)
    # Every case of the arithmetic (fp8_experts.fp8_every_case_block), as the kernel's first use checks it.
    block = fp8_experts.fp8_every_case_block("cuda")
    want_w, want_s = fp8_experts.fp8_reference(block, 1)
    got_w, got_s = torch.empty_like(want_w), torch.empty_like(want_s)
    fp8_experts._launch_fp8_blocks(block, 1, got_w, got_s)
    native_w, native_s = torch.empty_like(want_w), torch.empty_like(want_s)  # the GPU's own e4m3 cast
    fp8_experts._launch_fp8_blocks(block, 1, native_w, native_s, native=True)
    row = {
        "shape": "every case [129, 128, 128]",
        "fill": "every amax mantissa, every element below it",
        **compared((got_w, got_s), (want_w, want_s)),
        "native_identical": fp8_experts._same_bytes((native_w, native_s), (want_w, want_s)),
    }
    failures += not (row["weight_identical"] and row["scales_identical"])
    results.append(row)
    print(json.dumps(row), flush=True)
    # Does PyTorch on CUDA divide by a Python number as a multiplication by its fp32 reciprocal?
    amax = torch.rand(1 << 24, device="cuda") * 100
    division = {
        "divide_equals_times_reciprocal": torch.equal(amax / 448.0, amax * (1.0 / 448.0)),
        "divide_equals_ieee": torch.equal(amax / 448.0, amax / torch.full_like(amax, 448.0)),
    }
    print(json.dumps(division))
    out = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "command": "python scripts/fp8_quantizer_check.py",
        "commit": os.environ.get("COMMIT"),
        "cases": results,
        "torch_division": division,
        "all_identical": failures == 0,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    print("all identical" if failures == 0 else f"{failures} cases differ")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
