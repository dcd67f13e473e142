# SPDX-License-Identifier: Apache-2.0
"""On a GPU: what vLLM's start keeps in its sleep-mode pool while it quantizes the routed experts to FP8, layer by
layer, with this process's allocator settings or with those vllm_adapter.serve_env gives an FP8 server (--serve-env).

    python scripts/fp8_start_memory_check.py [--serve-env] [--split-mb 20] [--layers 3] [--json OUT]

It does what vLLM 0.34's start does for each MoE layer of the Moonlight-16B-A3B shape served in FP8 (the dummy
loader's online quantization: the layer's bf16 experts materialized and filled, then fp8.py's
process_weights_after_loading, vLLM's compiled per_block_cast_to_fp8 on each expert's w13 and w2, the bf16 freed),
inside what vLLM's load_model puts around it: the sleep-mode allocator's "weights" pool and vLLM's own
_scoped_allocator_max_split(20) (--split-mb: another limit in its place, a change to vLLM that would do
what --serve-env does). After each layer it prints the bytes mapped for that pool and the part of them
that is neither the FP8 weights and scales kept nor one layer's bf16 (freed, kept by PyTorch for the next layer):
what the start holds for nothing, which on vLLM's defaults grows by 128 segments of 20 MiB a layer. From that, the
pool's peak for the whole model's 26 such layers beside its 2.92 GiB of other weights.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
GiB = 1024**3
EXPERTS, HIDDEN, INTERMEDIATE = 64, 2048, 1408  # Moonlight-16B-A3B's routed experts
MOE_LAYERS, OTHER_WEIGHTS_GIB = 26, 2.9155  # its MoE layers, and its weights other than the routed experts


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--serve-env", action="store_true", help="run with vllm_adapter.serve_env('fp8') applied first")
    p.add_argument("--split-mb", type=int, default=20, help="the load's max_split_size_mb (vLLM 0.34's: 20)")
    p.add_argument("--layers", type=int, default=3, help="MoE layers to quantize (default 3)")
    p.add_argument("--json", metavar="OUT", help="also write the numbers as JSON here")
    return p.parse_args(argv)


def with_serve_env(argv: list[str]) -> None:
    """Run this program again, in a fresh process, with serve_env's variables: PyTorch reads them at its start."""
    sys.path.insert(0, str(HERE))
    from weight_sync import vllm_adapter

    env = {**os.environ, **vllm_adapter.serve_env("fp8"), "FP8_START_CHECK_ENV_APPLIED": "1"}
    os.execve(sys.executable, [sys.executable, __file__, *argv], env)


def mapped_bytes(allocator, tag: str) -> int:
    """Return the bytes the sleep-mode allocator has mapped for pools of this tag."""
    return sum(data.handle[1] for data in allocator.pointer_to_data.values() if data.tag == tag and not data.is_asleep)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.serve_env and not os.environ.get("FP8_START_CHECK_ENV_APPLIED"):
        with_serve_env(argv)

    import torch
    import vllm
    from vllm.device_allocator.cumem import CuMemAllocator
    from vllm.platforms import current_platform
    from vllm.utils.deep_gemm import per_block_cast_to_fp8
    from vllm.v1.worker.gpu_worker import Worker

    settings = torch._C._accelerator_getAllocatorSettings()
    print(
        f"[check] vLLM {vllm.__version__}, torch {torch.__version__}; PYTORCH_CUDA_ALLOC_CONF="
        f"{os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')!r}, allocator settings {settings!r}",
        flush=True,
    )
    torch.cuda.set_device(0)
    print(f"[check] on {torch.cuda.get_device_name()}", flush=True)
    fp8, block = current_platform.fp8_dtype(), [128, 128]
    w13_shape, w2_shape = (EXPERTS, 2 * INTERMEDIATE, HIDDEN), (EXPERTS, HIDDEN, INTERMEDIATE)
    bf16_layer = 2 * (EXPERTS * 2 * INTERMEDIATE * HIDDEN + EXPERTS * HIDDEN * INTERMEDIATE)
    allocator = CuMemAllocator.get_instance()
    kept, rows, start = [], [], time.perf_counter()
    # As vLLM 0.34's Worker.load_model: the "weights" pool, and its split limit, which it reads back from PyTorch.
    split = Worker._scoped_allocator_max_split(None, max_split_size_mb=args.split_mb)
    with allocator.use_memory_pool(tag="weights"), split:
        inside = torch._C._accelerator_getAllocatorSettings()
        print(f"[check] inside vLLM's load: allocator settings {inside!r}", flush=True)
        for layer in range(args.layers):
            # The dummy loader: each bf16 tensor materialized zeroed, then filled (materialize_layer and
            # initialize_single_dummy_weight), then the layer quantized as fp8.py's Fp8PerBlockOnlineMoEMethod does.
            w13 = torch.empty(w13_shape, dtype=torch.bfloat16, device="cuda").zero_().uniform_(-1e-3, 1e-3)
            w2 = torch.empty(w2_shape, dtype=torch.bfloat16, device="cuda").zero_().uniform_(-1e-3, 1e-3)
            q13, q2 = torch.empty_like(w13, dtype=fp8), torch.empty_like(w2, dtype=fp8)
            s13 = torch.ones(EXPERTS, -(-w13_shape[1] // 128), -(-w13_shape[2] // 128), device="cuda")
            s2 = torch.ones(EXPERTS, -(-w2_shape[1] // 128), -(-w2_shape[2] // 128), device="cuda")
            for expert in range(EXPERTS):
                q13[expert], s13[expert] = per_block_cast_to_fp8(w13[expert], block_size=block, use_ue8m0=False)
                q2[expert], s2[expert] = per_block_cast_to_fp8(w2[expert], block_size=block, use_ue8m0=False)
            kept.append((q13, q2, s13, s2))
            del w13, w2
            torch.cuda.synchronize()
            mapped = mapped_bytes(allocator, "weights")
            fp8_bytes = sum(t.nbytes for group in kept for t in group)
            rows.append(
                {
                    "layer": layer + 1,
                    "mapped": mapped,
                    "fp8_kept": fp8_bytes,
                    "held_for_nothing": mapped - fp8_bytes - bf16_layer,
                }
            )
            print(
                f"[check] layer {layer + 1}: {mapped / GiB:.2f} GiB mapped in the weights pool: "
                f"{fp8_bytes / GiB:.2f} FP8 weights and scales, {bf16_layer / GiB:.2f} one layer's bf16, "
                f"{rows[-1]['held_for_nothing'] / GiB:.2f} held for nothing",
                flush=True,
            )
    after = mapped_bytes(allocator, "weights")
    per_layer = (rows[-1]["held_for_nothing"] - rows[0]["held_for_nothing"]) / max(len(rows) - 1, 1)
    fp8_layer = rows[0]["fp8_kept"]
    peak = OTHER_WEIGHTS_GIB * GiB + MOE_LAYERS * fp8_layer + bf16_layer + rows[0]["held_for_nothing"]
    peak += (MOE_LAYERS - 1) * per_layer
    result = {
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "gpu_name": torch.cuda.get_device_name(),
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "load_split_mb": args.split_mb,
        "allocator_settings_in_load": inside,
        "layers": rows,
        "held_for_nothing_per_layer_bytes": per_layer,
        "mapped_after_load_bytes": after,
        "moonlight_start_pool_peak_gib": peak / GiB,
        "seconds": time.perf_counter() - start,
    }
    print(
        f"[check] held for nothing: {per_layer / 2**20:.0f} MiB more each layer; after the load vLLM trims the pool "
        f"to {after / GiB:.2f} GiB; a Moonlight-16B-A3B start in FP8 would map about {peak / GiB:.1f} GiB at its "
        f"peak in this pool (26 MoE layers, {OTHER_WEIGHTS_GIB:.2f} GiB of other weights)",
        flush=True,
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
