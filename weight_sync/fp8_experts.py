# SPDX-License-Identifier: Apache-2.0
"""Quantize each routed expert block to FP8 as the direct loader writes it.

This is used with --rollout-dtype fp8. It is optional: copy it beside
direct_load.py, which imports it when vLLM serves an expert layer in FP8.

When started with `--quantization online --quantization-config '{"moe":
"fp8_per_block"}'`, which is what serve_args gives for rollout_dtype="fp8",
vLLM holds each fused expert weight as float8_e4m3fn. Each shard, gate and
up, is padded with zeros to a multiple of 128 rows, and the columns to a
multiple of 128. Beside it is one fp32 scale per 128 x 128 block, such as
`w13_weight_scale_inv`. vLLM quantizes a bf16 load with
`per_block_cast_to_fp8` from vllm/utils/deep_gemm.py.

The direct loader writes the weight and the scales itself from the trainer's
bf16 block, in fp8_quantize_blocks. On a GPU that runs the same arithmetic in
one Triton kernel, checked once on that GPU against vLLM's function, byte for
byte, on every case of the arithmetic. Elsewhere it calls vLLM's function.
vLLM's MoE kernel must read the tensors exactly as they were quantized. The
Triton backends do, so start the server with `--moe-backend triton`.
FlashInfer's backend swaps gate and up and DeepGEMM's rescales, so both are
refused.
"""

from __future__ import annotations

import torch

FP8_BLOCK = 128
FP8_AS_QUANTIZED_BACKENDS = ("TRITON", "BATCHED_TRITON")  # vLLM's Fp8MoeBackend names


def fp8_shards(experts: torch.nn.Module, param_name: str) -> int:
    """Return how many row blocks, such as gate and up, a fused expert weight stacks; each is padded alone."""
    return getattr(getattr(experts, "moe_config", None), "w13_num_shards", 2) if param_name == "w13_weight" else 1


def fp8_padded_shape(shape, shards: int) -> tuple[int, ...]:
    """Return the FP8 shape in which vLLM holds a block of `shape`, [experts, shards x rows, columns]."""
    rows, columns = shape[-2] // shards, shape[-1]
    return (*shape[:-2], shards * -(-rows // FP8_BLOCK) * FP8_BLOCK, -(-columns // FP8_BLOCK) * FP8_BLOCK)


def fp8_backend_problem(experts: torch.nn.Module) -> str | None:
    """Say why this FP8 expert layer's kernel would not read the quantized tensors as written, or return None."""
    method = getattr(experts, "quant_method", None)  # A layer without one names no backend, and is refused.
    method = getattr(method, "old_quant_method", method)  # vLLM may wrap it in a modular kernel's method.
    backend = getattr(getattr(method, "fp8_backend", None), "name", None)
    if backend in FP8_AS_QUANTIZED_BACKENDS:
        return None
    return (
        f"vLLM's FP8 MoE backend here is {backend}, which lays the quantized experts out its own way; the "
        "direct loader writes them for the Triton backend: start the server with --moe-backend triton"
    )


def fp8_layout_problem(experts: torch.nn.Module, param_name: str, shape) -> str | None:
    """Say why this FP8 layer's weight and scales are not laid out as the kernel writes them, or return None.

    For a block of `shape`, the kernel writes float8_e4m3fn padded as fp8_padded_shape says and
    one fp32 scale per 128 x 128 block, both with contiguous rows.
    """
    weight, scales = getattr(experts, param_name), getattr(experts, f"{param_name}_scale_inv")
    padded = fp8_padded_shape(shape, fp8_shards(experts, param_name))
    want = (*padded[:-2], padded[-2] // FP8_BLOCK, padded[-1] // FP8_BLOCK)
    if (
        weight.dtype != torch.float8_e4m3fn
        or tuple(weight.shape) != padded
        or weight.stride(-1) != 1
        or scales.dtype != torch.float32
        or tuple(scales.shape) != want
        or scales.stride(-1) != 1
    ):
        return (
            f"vLLM holds it as {tuple(weight.shape)} {weight.dtype} with scales {tuple(scales.shape)} "
            f"{scales.dtype}, not as the direct loader writes a block of {tuple(shape)} ({padded} "
            f"float8_e4m3fn, scales {want} float32)"
        )
    return None


def fp8_scales_to_kernel(experts: torch.nn.Module) -> None:
    """Copy this layer's freshly written scales into the scale tensors vLLM's MoE kernel reads.

    Call it after a sync wrote the scales. The kernel may read other tensors than the layer's: a
    sync through vLLM's own loader rebuilds the kernel around new scale tensors, then copies them
    into the layer's original ones and puts those back on the layer, because captured CUDA graphs
    read those. The kernel's quantization config keeps the new ones, so without this copy every
    forward outside a CUDA graph would read the scales of the last sync through vLLM's loader.
    """
    method = getattr(experts, "quant_method", None)  # Without one there is no kernel to point at the scales.
    methods = (method, getattr(method, "old_quant_method", None))  # A modular kernel's method wraps the other.
    for quant_method in {id(m): m for m in methods if m is not None}.values():
        config = getattr(quant_method, "moe_quant_config", None)
        for config_name, param_name in (("w1_scale", "w13_weight_scale_inv"), ("w2_scale", "w2_weight_scale_inv")):
            in_use, written = getattr(config, config_name, None), getattr(experts, param_name)
            if not isinstance(in_use, torch.Tensor) or in_use.data_ptr() == written.data_ptr():
                continue
            if in_use.shape != written.shape or in_use.dtype != written.dtype:
                raise RuntimeError(
                    f"vLLM's FP8 MoE kernel reads {config_name} as {tuple(in_use.shape)} "
                    f"{in_use.dtype}, not as the layer's {param_name} {tuple(written.shape)}"
                )
            in_use.copy_(written)


def fp8_reference(block: torch.Tensor, shards: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a bf16 expert block with vLLM's own function; return the FP8 weight and fp32 block scales.

    `block` is [experts, shards x rows, columns]. The weight comes back padded as vLLM holds it,
    as vLLM's online per-block MoE method makes it. One call covers all experts, because once
    each shard is padded no 128 x 128 block straddles two experts or shards, and every block is
    quantized on its own.
    """
    from weight_sync.vllm_adapter import internal

    per_block_cast_to_fp8 = internal("vllm.utils.deep_gemm", "per_block_cast_to_fp8")
    padded_shape = fp8_padded_shape(block.shape, shards)
    experts, rows, columns = block.shape[0], block.shape[1] // shards, block.shape[2]
    padded = block.new_zeros(padded_shape)
    step = padded_shape[1] // shards
    for shard in range(shards):
        padded[:, shard * step : shard * step + rows, :columns] = block[:, shard * rows : (shard + 1) * rows]
    weight, scales = per_block_cast_to_fp8(padded.reshape(-1, padded_shape[2]), [FP8_BLOCK, FP8_BLOCK])
    return weight.view(padded_shape), scales.view(experts, padded_shape[1] // FP8_BLOCK, -1)


def fp8_every_case_block(device: torch.device | str = "cpu") -> torch.Tensor:
    """Build a bf16 block [129, 128, 128] that holds every case of per_block_cast_to_fp8's arithmetic.

    Each expert is one 128 x 128 tile. Cases are covered up to sign and powers of two: a tile's
    FP8 bytes depend only on its largest magnitude A and each element x, and scaling both by
    2**k changes neither the quotient x / scale nor how it rounds. Tile t < 128 has A = 1 + t/128,
    covering every bf16 mantissa, then every bf16 x from A * 2**-21 up to A; smaller values are 0
    in e4m3 however they round. Tile 128 has A just under the scale's floor of 1e-4, then every x
    up to it. A quantizer that gives vLLM's bytes here gives them for every block.
    """
    floor_bits = 0x38D1  # The largest bf16 below 1e-4.
    cases = [(0x3F80 + t, 0x3F80 + t - 21 * 128) for t in range(128)] + [(floor_bits, floor_bits - 21 * 128)]
    block = torch.zeros(len(cases), FP8_BLOCK * FP8_BLOCK, dtype=torch.int16)
    for tile, (amax, smallest) in enumerate(cases):
        every_x = torch.arange(smallest, amax, dtype=torch.int16)
        block[tile, 0] = amax
        block[tile, 1 : 1 + len(every_x)] = every_x
    block = block.view(torch.bfloat16).view(len(cases), FP8_BLOCK, FP8_BLOCK)
    block[:, 1::2] = -block[:, 1::2]  # Cover both signs.
    return block.to(device)


def fp8_quantize_blocks(block: torch.Tensor, shards: int, weight: torch.Tensor, scales: torch.Tensor) -> None:
    """Write fp8_reference(block, shards) into vLLM's `weight` and `scales` parameters.

    On a GPU this uses one Triton kernel that reads the block once, provided the kernel has
    matched vLLM's own function byte for byte on every case in fp8_every_case_block and on the
    first block it quantized on this GPU, fp8_warm_up's random expert when the direct loader sets
    up. If it has not, it warns and uses vLLM's function from then on, as it also
    does after an exact check has failed on an FP8 parameter; see exact_check_engine.py.
    """
    kernel = triton is not None and block.is_cuda and _KERNEL_AGREES.get(block.device) is not False
    if kernel:
        native = _NATIVE_CAST.get(block.device)
        if native is None:  # Use the GPU's own e4m3 cast, the fastest, if it gives vLLM's bytes on every case.
            native = _NATIVE_CAST[block.device] = _agrees_on_every_case(block.device, native=True)
        _launch_fp8_blocks(block, shards, weight, scales, native=native)
        if block.device in _KERNEL_AGREES:
            return
    quantized, block_scales = fp8_reference(block, shards)
    if kernel:  # First block on this GPU: check the kernel against vLLM's function on it and on every case.
        agrees = _same_bytes((weight, scales), (quantized, block_scales)) and (
            native or _agrees_on_every_case(block.device)
        )
        _KERNEL_AGREES[block.device] = agrees
        gpu = f"{block.device} ({torch.cuda.get_device_name(block.device)})"
        if agrees:
            print(
                f"[direct_load] the FP8 kernel makes vLLM's per_block_cast_to_fp8's bytes on {gpu}, for every "
                "case and the first block: quantizing with it",
                flush=True,
            )
            return
        print(
            f"[direct_load] warning: the FP8 kernel's bytes differ from vLLM's per_block_cast_to_fp8 on {gpu}: "
            "quantizing through vLLM's function (slower)",
            flush=True,
        )
    weight.copy_(quantized)
    scales.copy_(block_scales)


def fp8_warm_up(experts: torch.nn.Module, param_name: str, shape) -> None:
    """Make the kernel's choices for this layer's blocks before the first sync, on one random expert.

    `shape` is the shape of a bf16 block the trainer sends. fp8_quantize_blocks compiles the kernel for the
    block's shape, checks it on every case and on this block, and keeps its choice, so the first sync
    quantizes at full speed. The result goes to scratch tensors; the layer's own stay as they are. A private
    generator leaves the engine's sampling RNG alone.
    """
    weight, scales = getattr(experts, param_name), getattr(experts, f"{param_name}_scale_inv")
    generator = torch.Generator(device=weight.device).manual_seed(0)
    block = torch.randn((1, *shape[1:]), generator=generator, device=weight.device).to(torch.bfloat16)
    scratch = [torch.empty((1, *t.shape[1:]), dtype=t.dtype, device=t.device) for t in (weight, scales)]
    fp8_quantize_blocks(block, fp8_shards(experts, param_name), *scratch)


_KERNEL_AGREES: dict[torch.device, bool] = {}  # Per GPU: whether the kernel's first check matched vLLM's function.
_NATIVE_CAST: dict[torch.device, bool] = {}  # Per GPU: whether the kernel uses the GPU's own e4m3 conversion.


def _same_bytes(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Return whether two (FP8 weight, fp32 scales) pairs are equal byte for byte."""
    return torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(
        got[1].view(torch.int32), want[1].view(torch.int32)
    )


def _agrees_on_every_case(device: torch.device, native: bool = False) -> bool:
    """Return whether the kernel on `device` quantizes fp8_every_case_block as vLLM's function does."""
    block = fp8_every_case_block(device)
    want = fp8_reference(block, 1)
    got = (torch.empty_like(want[0]), torch.empty_like(want[1]))
    _launch_fp8_blocks(block, 1, *got, native=native)
    return _same_bytes(got, want)


def _launch_fp8_blocks(
    block, shards: int, weight, scales, divide: bool = False, native: bool = False, num_warps: int = 4
) -> None:
    """Run the kernel over every 128 x 128 block of every expert.

    With `divide`, the scale is amax / 448 in IEEE division, as PyTorch computes it on a CPU,
    instead of amax times fp32(1 / 448), as on CUDA. With `native`, the GPU's own float32 -> e4m3
    conversion is used instead of the written-out arithmetic, which Triton's CPU interpreter can
    also run. `num_warps` (Triton's threads per block, in 32s) changes the speed, never the bytes.
    """
    rows, columns = block.shape[1] // shards, block.shape[2]
    grid = (weight.shape[1] // FP8_BLOCK, weight.shape[2] // FP8_BLOCK, block.shape[0])
    _fp8_blocks_kernel[grid](
        block,
        weight.view(torch.uint8),
        scales,
        rows,
        weight.shape[1] // shards,
        columns,
        *block.stride(),
        *weight.stride()[:2],
        *scales.stride()[:2],
        BLOCK=FP8_BLOCK,
        DIVIDE=divide,
        NATIVE=native,
        num_warps=num_warps,
    )


try:  # vLLM's GPU builds depend on Triton; without it, vLLM's own function quantizes.
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:

    @triton.jit
    def _e4m3_bits(x):
        # Convert float32 to float8_e4m3fn bits as PyTorch's c10 fp8e4m3fn_from_fp32_value does,
        # for |x| < 464: round to nearest even, and below e4m3's normal range use a float addition.
        # On an H200 this gives the same bytes as Triton's own cast. It is written out so the
        # kernel can be tested on CPU, where Triton's interpreter casts powers of two wrongly.
        bits = x.to(tl.uint32, bitcast=True).to(tl.int64)
        sign = bits & 0x80000000
        magnitude = bits ^ sign
        subnormal = (magnitude.to(tl.uint32).to(tl.float32, bitcast=True) + 16384.0).to(tl.uint32, bitcast=True)
        subnormal = subnormal.to(tl.int64) - (141 << 23)
        normal = ((magnitude + 0xC407FFFF + ((magnitude >> 20) & 1)) & 0xFFFFFFFF) >> 20  # Rebias exponent 127 -> 7.
        out = tl.where(magnitude < (121 << 23), subnormal, normal) | (sign >> 24)
        return (out & 0xFF).to(tl.uint8)

    @triton.jit
    def _fp8_blocks_kernel(
        block,
        weight,
        scales,
        rows,
        padded_rows,
        columns,
        block_e,
        block_r,
        block_c,
        weight_e,
        weight_r,
        scales_e,
        scales_r,
        BLOCK: tl.constexpr,
        DIVIDE: tl.constexpr,
        NATIVE: tl.constexpr,
    ):
        # Quantize one 128 x 128 block of one expert's padded weight with the arithmetic of
        # per_block_cast_to_fp8, which vLLM compiles with torch.compile. amax is fp32 and at least
        # 1e-4, the scale is amax / 448, and each element times 1 / scale is cast to e4m3 rounding
        # to nearest even; here |x| <= 448 * (1 + 2**-23), within _e4m3_bits' range. A CPU and a
        # GPU round the two divisions differently; DIVIDE selects the CPU's IEEE division, and
        # fp8_quantize_blocks checks the result once per GPU.
        expert = tl.program_id(2).to(tl.int64)
        row = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # Row in the padded layout.
        column = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        shard = row // padded_rows
        in_shard = row - shard * padded_rows
        inside = (in_shard < rows)[:, None] & (column < columns)[None, :]
        source = block + expert * block_e + (shard * rows + in_shard)[:, None] * block_r + column[None, :] * block_c
        x = tl.load(source, mask=inside, other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.max(tl.abs(x), axis=1), axis=0), 1e-4)
        if DIVIDE:  # As on a CPU.
            scale = tl.math.div_rn(amax, 448.0)
            scaled = x * tl.math.div_rn(1.0, scale)
        else:  # As TorchInductor's generated code does on CUDA, with Triton's own division.
            scale = amax * (1.0 / 448.0)
            scaled = x * (1.0 / scale)
        if NATIVE:  # One GPU conversion instruction; it rounds to nearest even and saturates at 448.
            quantized = scaled.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:  # The same conversion in 64-bit integer arithmetic, which the GPU emulates.
            quantized = _e4m3_bits(scaled)
        tl.store(weight + expert * weight_e + row[:, None] * weight_r + column[None, :], quantized)
        tl.store(scales + expert * scales_e + tl.program_id(0) * scales_r + tl.program_id(1), scale)
