# SPDX-License-Identifier: Apache-2.0
"""Define the proof's flags, and refuse a run before any GPU work when it cannot succeed.

The script refuses flags that do not fit together, paths it cannot write, two trainer ranks on one GPU, and a
model the sync cannot move as asked. A model is refused when a parameter is larger than the packed buffer, a
packed tensor would be misaligned, the direct loader cannot split its experts, FP8 cannot quantize them, or the
machine lacks FP8's kernels.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from proof.logprob_gate import QUANTILE
from weight_sync import models, sources
from weight_sync.vllm_adapter import internal


def add_arguments(parser) -> None:
    """Add the checks' flags to `parser`."""
    add = parser.add_argument
    add(
        "--logprob-mean-tolerance",
        type=float,
        default=0.1,
        help="largest accepted mean |trainer - vLLM| "
        "log-probability (nats) after a sync, on the worst DP engine; --noise-multiple times the trainer's own "
        "kernel noise (two attention implementations; with FP8, plus FP8's own), if higher",
    )
    add(
        "--logprob-quantile-tolerance",
        type=float,
        default=1.0,
        help=f"the same for the {QUANTILE * 100:.0f}%% quantile of |trainer - vLLM| over the tokens",
    )  # %% is argparse's escape for "%".
    add(
        "--logprob-max-tolerance",
        type=float,
        help="also gate the single worst token (off by default: "
        "the max over many sampled tokens grows with their number)",
    )
    add(
        "--noise-multiple",
        type=float,
        default=2.0,
        help="after a sync, |trainer - vLLM| may be this many "
        "times the trainer's own kernel noise, measured on identical weights before the first sync",
    )
    add(
        "--memory-growth-tolerance-gib",
        type=float,
        default=0.5,
        help="fail if GPU memory after a sync grows more than this from round 2 to the last",
    )
    add(
        "--check-coverage",
        action="store_true",
        help="before round 1, zero every vLLM parameter, sync, "
        "and fail unless every parameter on every DP rank was written (slow)",
    )
    add("--json", metavar="PATH", help="also write the results as JSON here")


def flag_problem(args) -> str | None:
    """Say why the script's flags cannot work together, or return None."""
    problems = [
        (args.num_gpus < 1, "--num-gpus must be at least 1"),
        (
            args.tensor_parallel_size < 1 or args.num_gpus % args.tensor_parallel_size,
            f"--num-gpus {args.num_gpus} is not divisible by --tensor-parallel-size {args.tensor_parallel_size}",
        ),
        (
            args.tensor_parallel_size < 1
            or args.num_nodes < 1
            or args.num_gpus % (args.num_nodes * args.tensor_parallel_size),
            f"--num-gpus {args.num_gpus} does not split into --num-nodes {args.num_nodes} equal nodes of whole "
            f"tensor-parallel groups of {args.tensor_parallel_size}",
        ),
        (not 0 < args.gpu_memory_utilization < 1, "--gpu-memory-utilization must be between 0 and 1"),
        (args.packed_buffer_size_bytes < 1, "--packed-buffer-size-bytes must be positive"),
        (
            args.kv_cache_memory_bytes is not None and args.kv_cache_memory_bytes < 1,
            "--kv-cache-memory-bytes must be positive",
        ),
        (args.kv_cache_tokens is not None and args.kv_cache_tokens < 0, "--kv-cache-tokens must be 0 or more"),
        (
            args.kv_cache_tokens and args.kv_cache_memory_bytes,
            "--kv-cache-tokens and --kv-cache-memory-bytes both size the KV cache: pass one",
        ),
        (
            args.rounds < 1 or args.max_tokens < 1 or args.samples_per_prompt < 1,
            "--rounds, --max-tokens and --samples-per-prompt must be at least 1",
        ),
        (args.soak_seconds < 0, "--soak-seconds must be at least 0"),
        (args.send_retries < 0, "--send-retries must be 0 or more"),
        # Each range test is written so that NaN, which argparse's float() accepts, fails it.
        (args.train and not 0 < args.lr < math.inf, "--lr must be a finite number above 0"),
        (args.train and not 0 <= args.temperature <= 2, "--temperature must be between 0 and 2, as vLLM takes it"),
        (not args.noise_multiple >= 0, "--noise-multiple must be 0 or more"),
        *(
            (value is not None and not value >= 0, f"--logprob-{name}-tolerance must be 0 or more")
            for name, value in [
                ("mean", args.logprob_mean_tolerance),
                ("quantile", args.logprob_quantile_tolerance),
                ("max", args.logprob_max_tolerance),
            ]
        ),
        (
            args.free_kv_cache is False and args.sleep_level > 0,
            f"--no-free-kv-cache needs --sleep-level 0 (level {args.sleep_level} frees the KV cache with the weights)",
        ),
        (any(not prompt.strip() for prompt in args.prompts), "--prompt must not be empty"),
    ]
    return (
        next((text for wrong, text in problems if wrong), None)
        or unwritable("--json", args.json)
        or unwritable("--server-log", args.server_log)
        or loader_flag_problem(args, args.weight_loader)
    )


def unwritable(flag: str, path: str | None) -> str | None:
    """Say why the run could not write `path`, or return None.

    The run writes such a file from its start or at its end; checking first fails before any GPU work rather
    than after the whole run.
    """
    if not path:
        return None
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        return f"{flag} {path} is a directory"
    if not folder.is_dir():
        return f"{flag} {path}: {folder} is not a directory"
    if not os.access(target if target.exists() else folder, os.W_OK):
        return f"{flag} {path} is not writable"
    if not target.exists():  # root passes os.access where the kernel still refuses a new file, as in /proc
        try:
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            target.unlink()
        except OSError as e:
            return f"{flag} {path} is not writable ({e.strerror})"
    return None


def loader_flag_problem(args, loader: str) -> str | None:
    """Say why `loader` cannot run with these flags, or return None."""
    if loader == "direct" and not args.packed:
        return "--weight-loader direct reads packed buffers: drop --no-packed or pass --weight-loader vllm"
    if loader == "direct" and args.tensor_parallel_size != 1:
        return "--weight-loader direct needs --tensor-parallel-size 1; pass --weight-loader vllm"
    if args.rollout_dtype == "fp8" and args.tensor_parallel_size != 1:
        return "--rollout-dtype fp8 is tested with --tensor-parallel-size 1 only (the exact check proves its bytes)"
    return None


def before_gpu_work(args, model_path, loaders: list[str]) -> None:
    """Exit with one line if the model cannot be synced as asked.

    That is a checkpoint without the safetensors files the trainer ranks read, a parameter larger than the
    packed buffer, a packed tensor that would be misaligned, experts the direct loader cannot split, or an FP8
    run that cannot work.
    """
    if args.model not in models.PRESETS and not models.checkpoint_files(Path(model_path)):
        raise SystemExit(
            f"error: {model_path} has no safetensors files (model.safetensors, or an index of them): "
            "the trainer ranks read their shards from those"
        )
    meta = models.meta_model(model_path)
    if args.packed:
        name, size = models.largest_parameter(meta)
        if size > args.packed_buffer_size_bytes:
            raise SystemExit(
                f"error: --packed-buffer-size-bytes {args.packed_buffer_size_bytes} is smaller than "
                f"the largest parameter, {name} ({size} bytes); pass at least {size}"
            )
        if problem := packing_problem(sources.CheckpointForm(meta, torch.bfloat16).metadata):
            raise SystemExit(f"error: {problem}")
    if "direct" in loaders and (problem := sources.direct_loader_problem(meta, args.num_gpus)):
        raise SystemExit(f"error: {problem}")
    if args.rollout_dtype == "fp8" and (problem := fp8_problem(meta) or fp8_backend_problem(gpu_capabilities())):
        raise SystemExit(f"error: {problem}")


def fp8_problem(model: torch.nn.Module) -> str | None:
    """Say why --rollout-dtype fp8 cannot serve this model, or return None; a meta model is enough.

    FP8 quantizes only the routed experts, so a model without fused experts would be served unchanged. Experts
    with biases are refused because vLLM's online FP8 refuses them when it pads the experts to 128.
    """
    experts = sources.fused_expert_tensors(model)
    if not experts:
        return "--rollout-dtype fp8 serves the routed experts in FP8, and this model has none; drop it"
    if biased := sorted(
        n
        for n, p in model.named_parameters()
        if n.rpartition(".")[0] in {e.rpartition(".")[0] for e in experts} and p.dim() == 2 and n.endswith("_bias")
    ):
        return f"--rollout-dtype fp8 does not quantize experts with biases ({biased[0]}); drop it"
    if odd := sorted(n for n, layout in experts.items() if layout["transposed"] or not layout["concatenated"]):
        return (
            f"--rollout-dtype fp8 needs the trainer's fused experts in vLLM's layout (gate rows, then up "
            f"rows), not {odd[0]}'s; drop it"
        )
    return None


def fp8_backend_problem(capabilities: dict[int, tuple[int, int]]) -> str | None:
    """Say why this machine cannot run the FP8 experts, or return None.

    vLLM's FP8 MoE kernel with --moe-backend triton and the direct loader's quantizer are Triton kernels, and
    they need GPUs with FP8 arithmetic, compute capability 8.9 or later. `capabilities` maps GPU index to
    (major, minor), and is empty on a machine without GPUs.
    """
    try:
        import triton  # noqa: F401
    except ImportError:
        return (
            "--rollout-dtype fp8 runs Triton kernels (vLLM's FP8 MoE, the FP8 quantizer), and Triton is not installed"
        )
    if old := {i: c for i, c in capabilities.items() if c < (8, 9)}:
        i, (major, minor) = next(iter(old.items()))
        return (
            f"--rollout-dtype fp8 needs GPUs with FP8 arithmetic (compute capability 8.9 or later); "
            f"GPU {i} is {major}.{minor}"
        )
    return None


def gpu_capabilities() -> dict[int, tuple[int, int]]:
    """Return each GPU's compute capability, read as vLLM reads it; empty on other platforms.

    On NVIDIA vLLM reads it through NVML, which creates no CUDA context and so takes no GPU memory.
    """
    platform = internal("vllm.platforms", "current_platform", None)
    if platform is None or not platform.is_cuda():
        return {}
    found = {i: platform.get_device_capability(i) for i in range(platform.device_count())}
    return {i: tuple(capability) for i, capability in found.items() if capability is not None}


def placement_problem(placements: list[dict]) -> str | None:
    """Say why the trainer ranks Ray placed cannot sync, or return None.

    Two ranks must not share a GPU: vLLM keeps one IPC handle per GPU and each engine reads the buffer of the
    one rank on its GPU, so the other rank's weights would be lost.
    """
    uuids = [p.get("gpu_uuid") for p in placements]
    shared = sorted({u for u in uuids if u and uuids.count(u) > 1})
    if shared:
        ranks = [[i for i, u in enumerate(uuids) if u == s] for s in shared]
        return f"trainer ranks {ranks[0]} share GPU {shared[0]}: the sync needs one rank per GPU"
    return None


def packing_problem(metadata: list[tuple[str, tuple, torch.dtype]]) -> str | None:
    """Say why vLLM's packed IPC buffer cannot hold these tensors, or return None.

    The buffer holds the tensors back to back, unpadded, and views each at its offset. After a tensor whose
    size is not a multiple of the widest element, such as an odd-length bf16 tensor before a router's fp32
    bias, the next view fails in the middle of a send.
    """
    widest = max(dtype.itemsize for _, _, dtype in metadata)
    for name, shape, dtype in metadata:
        if (size := math.prod(shape) * dtype.itemsize) % widest:
            return (
                f"{name} is {size} bytes, not a multiple of {widest}: vLLM's packed IPC buffer would "
                f"misalign the {widest}-byte tensors after it; pass --no-packed --weight-loader vllm"
            )
    return None
