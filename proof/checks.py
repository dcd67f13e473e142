# SPDX-License-Identifier: Apache-2.0
"""Proof and numbers for rlhf_ipc_fsdp_ep.py: the logprob gate, sync coverage,
memory, the round records, the summary and the JSON; and `measure`, which
times and inspects a trainer's sends and steps from outside its code.

Nothing here moves weights: rlhf_ipc_fsdp_ep.py does, and calls these around it.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import math
import os
import re
import shlex
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import ray
import torch
import torch.distributed as dist

import helpers
from proof import exact_check_engine
from weight_sync import fp8_experts, models, multinode, sources
from weight_sync.direct_load import TrainerSource

GiB = 1024**3
SYNC_PHASES = ("sleep", "wake_weights", "send", "wake_kv")


# ---------------------------------------------------------------------------
# The proof's routes
# ---------------------------------------------------------------------------


def prompt_logprobs(sock: str, model: str, token_ids: list[int], dp_rank: int | None = None) -> list[float]:
    """vLLM's log-probability of each prompt token given the ones before it
    (len(token_ids) - 1 values). `dp_rank` pins the request to one DP engine."""
    out = helpers.post_completions(
        sock, dp_rank, model=model, prompt=token_ids, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 0}
    )
    per_position = out.choices[0].prompt_logprobs
    # Position 0 has no context (None); each later entry maps token id -> info
    # and always holds the prompt's own token.
    return [entry[str(tok)]["logprob"] for tok, entry in zip(token_ids[1:], per_position[1:], strict=True)]


def weight_checker(sock: str, action: str, baseline: dict | None = None) -> dict:
    """POST /weight_checker: 'reset' zeroes every parameter, 'checksum' returns
    {key: sha256}, 'compare' checks against a baseline."""
    body = {"action": action, **({"baseline": baseline} if baseline is not None else {})}
    return helpers.request(sock, "POST", "/weight_checker", json=body)


# ---------------------------------------------------------------------------
# Input: what can be refused before anything touches a GPU
# ---------------------------------------------------------------------------


def flag_problem(args) -> str | None:
    """Why the script's flags cannot work together, or None."""
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
    """Why the run could not write `path` (a file it writes at the end, or from
    its start), or None: asked before any GPU work, not after the whole run."""
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
    return None


def loader_flag_problem(args, loader: str) -> str | None:
    """Why `loader` cannot run with these flags, or None."""
    if loader == "direct" and not args.packed:
        return "--weight-loader direct reads packed buffers: drop --no-packed or pass --weight-loader vllm"
    if loader == "direct" and args.tensor_parallel_size != 1:
        return "--weight-loader direct needs --tensor-parallel-size 1; pass --weight-loader vllm"
    if args.rollout_dtype == "fp8" and args.tensor_parallel_size != 1:
        return "--rollout-dtype fp8 is tested with --tensor-parallel-size 1 only (the exact check proves its bytes)"
    return None


def before_gpu_work(args, model_path, loaders: list[str]) -> None:
    """Exit with one line if the model cannot be synced as asked: a checkpoint
    without safetensors files (what the trainer ranks read), a parameter
    larger than the packed buffer, or experts the direct loader cannot split."""
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
    """Why --rollout-dtype fp8 cannot serve this model (a meta model will do),
    or None: it quantizes the routed experts, so a model without fused experts
    would be served as it is; experts with biases are not quantized here
    (vLLM's online FP8 refuses them when it pads the experts to 128)."""
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
    """Why this machine cannot run the FP8 experts, or None: vLLM's FP8 MoE
    kernel (--moe-backend triton) and the direct loader's quantizer are Triton
    kernels, for GPUs with FP8 arithmetic (compute capability 8.9 or later;
    `capabilities`: GPU index -> (major, minor), none where there are none)."""
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
    """Each GPU's compute capability, read as vLLM reads it (NVML on NVIDIA:
    no CUDA context, so no GPU memory taken); empty on other platforms."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return {}
    found = {i: current_platform.get_device_capability(i) for i in range(current_platform.device_count())}
    return {i: tuple(capability) for i, capability in found.items() if capability is not None}


def placement_problem(placements: list[dict]) -> str | None:
    """Why the trainer ranks Ray placed cannot sync, or None: two ranks on
    one GPU (one engine per GPU reads the IPC buffer of "the" rank on its GPU,
    and vLLM keeps one handle per GPU, so one rank's weights would be lost)."""
    uuids = [p.get("gpu_uuid") for p in placements]
    shared = sorted({u for u in uuids if u and uuids.count(u) > 1})
    if shared:
        ranks = [[i for i, u in enumerate(uuids) if u == s] for s in shared]
        return f"trainer ranks {ranks[0]} share GPU {shared[0]}: the sync needs one rank per GPU"
    return None


def packing_problem(metadata: list[tuple[str, tuple, torch.dtype]]) -> str | None:
    """vLLM's packed IPC buffer holds the tensors back to back, unpadded, and
    views each at its offset: after a tensor whose size is not a multiple of
    the widest element (e.g. an odd-length bf16 tensor before a router's fp32
    bias) the view fails mid-send. None if every size is a multiple of it."""
    widest = max(dtype.itemsize for _, _, dtype in metadata)
    for name, shape, dtype in metadata:
        if (size := math.prod(shape) * dtype.itemsize) % widest:
            return (
                f"{name} is {size} bytes, not a multiple of {widest}: vLLM's packed IPC buffer would "
                f"misalign the {widest}-byte tensors after it; pass --no-packed --weight-loader vllm"
            )
    return None


def _worst(values: list[float]) -> float:
    """The largest value, NaN if any is NaN (max() alone may skip a NaN)."""
    return math.nan if any(math.isnan(v) for v in values) else max(values)


# ---------------------------------------------------------------------------
# The logprob gate
# ---------------------------------------------------------------------------


@dataclass
class LogprobGap:
    """|trainer - vLLM| prompt log-probabilities on the same tokens, per DP
    engine (each holds different experts, so each is asked)."""

    mean_per_dp_rank: list[float]
    max_per_dp_rank: list[float]
    server: list[list[list[float]]]  # per DP rank, per sequence, per token
    trainer: list[list[float]] | None = None  # per sequence, per token
    quantile_per_dp_rank: list[float] | None = None  # the QUANTILE of |dlogp| per DP rank

    @property
    def mean(self) -> float:  # the worst engine's
        return _worst(self.mean_per_dp_rank)

    @property
    def max(self) -> float:
        return _worst(self.max_per_dp_rank)

    @property
    def quantile(self) -> float:
        return _worst(self.quantile_per_dp_rank or self.max_per_dp_rank)


QUANTILE = 0.95  # of |dlogp| over the tokens: the max grows with the token count, and bf16 kernels differ


def dlogp_stats(reference: list[list[float]], other: list[list[float]]) -> tuple[float, float]:
    """(max, mean) |a - b| over every token of every sequence; NaN anywhere
    makes both NaN, which fails any `<= tolerance` gate."""
    diffs = _abs_diffs(reference, other)
    return _worst(diffs), sum(diffs) / len(diffs)


def dlogp_quantile(reference: list[list[float]], other: list[list[float]], q: float = QUANTILE) -> float:
    """The q-quantile of |a - b| over every token (nearest rank); NaN if any is NaN."""
    diffs = _abs_diffs(reference, other)
    if any(math.isnan(d) for d in diffs):
        return math.nan
    return sorted(diffs)[min(len(diffs) - 1, math.ceil(q * len(diffs)) - 1)]


def _abs_diffs(reference: list[list[float]], other: list[list[float]]) -> list[float]:
    return [abs(d) for d in _diffs(other, reference)]


def _diffs(a: list[list[float]], b: list[list[float]]) -> list[float]:
    """a - b token by token, over every sequence, flattened."""
    diffs: list[float] = []
    for x, y in zip(a, b, strict=True):
        if len(x) != len(y):
            raise ValueError(f"sequence lengths differ: {len(y)} vs {len(x)}")
        diffs += [u - v for u, v in zip(x, y, strict=True)]
    if not diffs:
        raise ValueError("no tokens to compare")
    return diffs


def logprob_gap(
    sock: str, model: str, trainer_lps: list[list[float]], sequences: list[list[int]], dp_size: int
) -> LogprobGap:
    """Ask every DP engine for its prompt log-probabilities of `sequences`
    and compare them with the trainer's."""
    server = [[prompt_logprobs(sock, model, seq, dp_rank=dp_rank) for seq in sequences] for dp_rank in range(dp_size)]
    stats = [dlogp_stats(trainer_lps, lps) for lps in server]
    quantiles = [dlogp_quantile(trainer_lps, lps) for lps in server]
    return LogprobGap([mean for _, mean in stats], [worst for worst, _ in stats], server, trainer_lps, quantiles)


def trainer_logprobs(trainers: list, sequences: list[list[int]]) -> list[list[float]]:
    """The trainer's log-probabilities of `sequences` (every rank runs the forward)."""
    return helpers.ray_get_all([t.token_logprobs.remote(sequences) for t in trainers])[0]


def kernel_noise(trainers: list, sequences: list[list[int]], fp8: bool = False) -> KernelNoise | None:
    """KernelNoise on `sequences` (one extra forward, through the other
    attention implementation; with `fp8`, one more with the experts
    as vLLM serves them in FP8), printed; None where the model has only one
    attention implementation."""
    reference = trainer_logprobs(trainers, sequences)
    refs = [t.__ray_call__.remote(other_attention_logprobs, sequences) for t in trainers]
    other = helpers.ray_get_all(refs)[0]
    if other is None:
        print("[noise] the trainer's model has one attention implementation: no kernel noise measured", flush=True)
        if not fp8:
            return None
        noise = KernelNoise(0.0, 0.0, "one implementation")
    else:
        attention, lps = other
        noise = KernelNoise(dlogp_stats(reference, lps)[1], dlogp_quantile(reference, lps), attention)
        print(
            f"[noise] the trainer's own model, {attention} attention, identical weights: |dlogp| mean "
            f"{noise.mean:.4f}, p{QUANTILE * 100:.0f} {noise.quantile:.4f}",
            flush=True,
        )
    if fp8:
        lps = helpers.ray_get_all([t.__ray_call__.remote(fp8_experts_logprobs, sequences) for t in trainers])[0]
        noise.fp8_mean, noise.fp8_quantile = dlogp_stats(reference, lps)[1], dlogp_quantile(reference, lps)
        print(
            f"[noise] the trainer's own model, its experts in FP8 as vLLM serves them: |dlogp| mean "
            f"{noise.fp8_mean:.4f}, p{QUANTILE * 100:.0f} {noise.fp8_quantile:.4f} (added to the above: the "
            "gate's basis)",
            flush=True,
        )
    return noise


def job_logprob_gap(job, sequences: list[list[int]]) -> LogprobGap:
    """logprob_gap between a colocated job's trainers and every one of its DP engines."""
    return logprob_gap(
        job.server.socket_path, job.served_name, trainer_logprobs(job.trainers, sequences), sequences, job.dp_size
    )


def add_arguments(parser) -> None:
    """The checks' flags."""
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
    )  # (%% is argparse's "%")
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


@dataclass
class KernelNoise:
    """How far two correct bf16 forwards of the trainer's own model drift
    apart: |dlogp| between its attention through SDPA and through the eager
    code, same weights, same tokens. Small on a shallow model; on a deep one
    with random weights (the Moonlight shape) as large as the gap between the
    trainer and vLLM, which then says nothing against the sync."""

    mean: float
    quantile: float  # the QUANTILE of |dlogp|
    attention: str  # which two implementations, e.g. "sdpa vs eager"
    # --rollout-dtype fp8: the same between the trainer's model and itself with its experts
    # quantized as vLLM holds them (fp8_experts_logprobs): what FP8 alone moves
    fp8_mean: float | None = None
    fp8_quantile: float | None = None

    @property
    def bound_mean(self) -> float:
        """The gap a correct sync may show: the kernels' noise, plus FP8's where vLLM serves FP8."""
        return self.mean + (self.fp8_mean or 0.0)

    @property
    def bound_quantile(self) -> float:
        return self.quantile + (self.fp8_quantile or 0.0)


@dataclass
class Tolerances:
    mean: float  # the gate: wrong weights move every token
    quantile: float = 1.0  # the QUANTILE of |dlogp|: a guard against a few tokens grossly off
    max: float | None = None  # the single worst token, if asked for
    noise_multiple: float = 2.0
    kernel_noise: KernelNoise | None = None  # measured once, before the first sync

    @classmethod
    def from_args(cls, args, kernel_noise: KernelNoise | None = None) -> Tolerances:
        return cls(
            args.logprob_mean_tolerance,
            args.logprob_quantile_tolerance,
            args.logprob_max_tolerance,
            args.noise_multiple,
            kernel_noise,
        )

    def given(self, noise: LogprobGap | None = None) -> tuple[float, float]:
        """(mean, quantile) tolerances: the absolute ones, or `noise_multiple`
        times the trainer's own kernel noise (its bound: with FP8's) where
        that is larger. The basis is measured only where the weights are
        identical by construction, without vLLM: the trainer against itself.
        `noise`, a trainer-vs-vLLM gap (a round's `before`), is not a basis:
        it is what the gate judges, and the exact check that would vouch for
        it may itself be wrong, so a large gap in one round must not widen
        the next round's tolerance (it is taken, and ignored, so that a
        caller's round reads the same). Never tightened either."""
        del noise
        k = self.kernel_noise
        return (self._floor(self.mean, k and k.bound_mean), self._floor(self.quantile, k and k.bound_quantile))

    def _floor(self, absolute: float, kernel: float | None) -> float:
        """One of given()'s tolerances, from its absolute value and the kernel noise (None: not measured)."""
        return absolute if kernel is None else max(absolute, self.noise_multiple * kernel)


@dataclass
class ChangeTest:
    """Did vLLM's log-probabilities follow the trainer's step? Per token, the
    trainer's change (after - before) against vLLM's, on the worst engine."""

    trainer_change_rms: float
    noise_rms: float  # |trainer - vLLM| with identical weights
    residual_rms: float  # vLLM's change minus the trainer's
    verdict: str  # "followed", "did not follow", or "too small to see" (below the noise); reported, not gated


def change_test(before: LogprobGap, after: LogprobGap) -> ChangeTest | None:
    """After a step (before: vLLM held the previous sync, the trainer had not
    stepped; after: both should hold the stepped weights). None without the
    trainer's numbers."""
    if before.trainer is None or after.trainer is None:
        return None
    t_change = _diffs(after.trainer, before.trainer)
    trainer_rms = _rms(t_change)
    noise = max(_rms(_diffs(engine, before.trainer)) for engine in before.server)
    residual = 0.0
    for engine_before, engine_after in zip(before.server, after.server, strict=True):
        v_change = _diffs(engine_after, engine_before)
        residual = max(residual, _rms([v - t for v, t in zip(v_change, t_change, strict=True)]))
    if not trainer_rms > 3 * noise:
        verdict = "too small to see"
    else:
        verdict = "followed" if residual <= 0.5 * trainer_rms else "did not follow"
    return ChangeTest(trainer_rms, noise, residual, verdict)


def _rms(values: list[float]) -> float:
    return math.sqrt(sum(v * v for v in values) / len(values)) if values else 0.0


@dataclass
class Gate:
    passed: bool
    changed_per_dp_rank: list[bool]
    mean_tolerance: float | None = None  # as applied this round (given the trainer's kernel noise)
    quantile_tolerance: float | None = None
    change: ChangeTest | None = None


def gate(
    before: LogprobGap,
    after: LogprobGap,
    tolerances: Tolerances,
    weights_updated: bool,
    noise: LogprobGap | None = None,
    stepped: bool = False,
) -> Gate:
    """A round passes when EVERY engine is within the tolerances after the
    sync (Tolerances.given: from the trainer's own kernel noise, never from
    a trainer-vs-vLLM gap; `noise`, the gap before the sync on weights the
    previous exact check proved, is the change test's reference only); if
    the weights were updated, EVERY engine's log-probabilities changed (a sync that silently did nothing on one engine leaves its
    numbers exactly as they were: vLLM's outputs repeat bit for bit on the
    same weights, while the trainer's HF MoE forward need not); and, after a
    training step (`stepped`), the change test is reported (not gated: MoE
    routing near ties makes it too noisy to fail a round on; the exact check
    proves the bytes). `<=` is False for NaN."""
    changed = [b != a for b, a in zip(before.server, after.server, strict=True)]
    mean_tol, quantile_tol = tolerances.given(noise)
    change = change_test(before, after) if stepped and noise is not None else None
    passed = (
        after.mean <= mean_tol
        and after.quantile <= quantile_tol
        and (tolerances.max is None or after.max <= tolerances.max)
        and (all(changed) or not weights_updated)
    )
    return Gate(passed, changed, mean_tol, quantile_tol, change)


# ---------------------------------------------------------------------------
# Coverage: did the sync write every vLLM parameter?
# ---------------------------------------------------------------------------


def zero_vllm_weights(sock: str, sleep_level: int) -> dict[str, str]:
    """The first half of a sync (sleep, wake the weights), then zero every
    vLLM parameter on every DP rank; returns their checksums as zeros. What
    the sync then fails to write stays zero."""
    helpers.sleep_for_sync(sock, sleep_level)
    helpers.wake_weights(sock, sleep_level)
    weight_checker(sock, "reset")
    return weight_checker(sock, "checksum")["checksums"]


def check_coverage(job, sleep_level: int) -> dict:
    """A sync into zeroed vLLM weights: what it misses stays zero."""
    zeros = zero_vllm_weights(job.server.socket_path, sleep_level)
    helpers.send_all(
        job.trainers,
        job.server.socket_path,
        job.send_retries,
        check_failure=functools.partial(multinode.raise_node_failure, job.node_servers),
    )
    helpers.wake_to_serve(job.server.socket_path)
    result = coverage(job.server.socket_path, zeros)
    print(f"[coverage] {result['parameters']} vLLM parameters, unwritten: {result['unwritten']}", flush=True)
    return result


def coverage(sock: str, zeros: dict[str, str]) -> dict:
    """After a sync that followed zero_vllm_weights: which parameters it left
    zero (vLLM's /weight_checker: slow, it hashes every tensor)."""
    written = set(weight_checker(sock, "compare", baseline=zeros)["mismatches"])
    return {"parameters": len(zeros), "unwritten": sorted(set(zeros) - written)}


# ---------------------------------------------------------------------------
# The exact check: every engine holds, bit for bit, what the trainer sent
# ---------------------------------------------------------------------------


def prepare_exact_check(job) -> dict:
    """Tell every engine what the trainers' current weight source sends, so
    it learns which of its parameters each tensor is written into
    (ExactCheckWorker.exact_check_prepare, exact_check_engine.py). After setting up
    a loader's transfer, before a full sync: it leaves zeros where it probes."""
    sent = measured(job.trainers[:1], "sent_metadata")[0]
    answers = helpers.collective_rpc(job.server.socket_path, "exact_check_prepare", json.dumps(sent))
    answer = answers[0]
    # What vLLM holds in another dtype (JSON made the indices strings) is fingerprinted cast.
    # Where each piece of a stacked parameter lands in it: the trainer fingerprints it at those rows.
    rows = rows_on_every_engine(engines_rows(answers), [name for name, *_ in sent], job.dp_size)
    measured(job.trainers, "set_exact_casts", {int(i): d for i, d in answer["casts"].items()}, rows)
    if answer.get("by_value"):
        print(
            f"[exact] {len(answer['by_value'])} parameters, which vLLM lays out its own way, are compared by "
            f"their values, not element by element in their place: {answer['by_value'][:4]}",
            flush=True,
        )
    if answer.get("unchecked"):
        print(
            f"[exact] {len(answer['unchecked'])} parameters of FP8 expert layers, which vLLM's own loader "
            "quantizes from each expert's tensors, are not compared (benchmark.py --loaders direct vllm "
            "compares them with the direct loader's)",
            flush=True,
        )
    return answer


def engines_rows(answers: list[dict]) -> dict[int, int]:
    """The rows each piece of a stacked parameter lands at, from every DP
    engine's exact_check_prepare answer: each engine places the pieces it
    holds (vLLM's loader gives each its own experts' tensors), and the
    trainer ranks, whose fingerprints of a tensor add up over them, need one
    row per tensor, so two engines that place one differently are an error."""
    rows: dict[int, int] = {}
    for dp_rank, answer in enumerate(answers):
        for index, row in answer.get("rows", {}).items():
            if rows.setdefault(int(index), row) != row:
                raise RuntimeError(
                    f"exact check: DP engine {dp_rank} places sent tensor {index} at row {row}, "
                    f"another engine at row {rows[int(index)]}"
                )
    return rows


# One expert's tensor, as vLLM's own loader takes it (`<layer>.experts.<id>.<name>`).
_ONE_EXPERT = re.compile(r"^(.*\.experts\.)(\d+)(\..+)$")


def rows_on_every_engine(rows: dict[int, int], names: list[str], dp_size: int) -> dict[int, int]:
    """`rows` (engines_rows) with the rows of the experts' tensors that DP
    engines other than the first hold: /collective_rpc answers with the first
    engine's prepare alone, which places only its own experts. Under vLLM's
    linear expert placement engine k holds experts [k*E/D, (k+1)*E/D) in its
    slots in order, so expert e's tensor lands where expert e mod E/D's does on
    the first engine (E: the layer's experts, D: the DP engines)."""
    if dp_size <= 1:
        return rows
    where = {name: index for index, name in enumerate(names)}
    experts: dict[str, int] = {}
    for name in names:
        if found := _ONE_EXPERT.match(name):
            experts[found[1]] = max(experts.get(found[1], 0), int(found[2]) + 1)
    out = dict(rows)
    for index, name in enumerate(names):
        found = _ONE_EXPERT.match(name)
        if index in out or not found or experts[found[1]] % dp_size:
            continue
        first = where.get(f"{found[1]}{int(found[2]) % (experts[found[1]] // dp_size)}{found[3]}")
        if first is not None and first in rows:
            out[index] = rows[first]
    return out


@dataclass
class ExactCheck:
    """Whether every DP engine holds exactly what the trainer rank on its GPU
    sent (ExactCheckWorker.exact_check, exact_check_engine.py), per vLLM parameter."""

    passed: bool
    seconds: float  # from the start to the verdict: both sides' fingerprints and the comparison (beside the gate)
    parameters_per_engine: int | None  # checked on each engine (DP engine 0's count; all engines check all theirs)
    dp_engines: int
    problem: str | None = None  # the first engine's words: which parameters differ
    trainer_seconds: float | None = None  # of `seconds`: both sides started, the trainers' sums read back
    engine_seconds: float | None = None  # DP engine 0's, inside its exact_check call (None if it failed)
    wait_seconds: float | None = None  # what the check added to the round: its wait for the verdict after the gate


_running_checks: set[concurrent.futures.Future] = set()  # started, verdict not yet in (settle_exact_checks)


def start_exact_check(job) -> concurrent.futures.Future:
    """After a sync: the exact check, in a thread of its own, beside what the
    round does next (the gate's requests). Every trainer rank and every DP
    engine start fingerprinting on CUDA streams of their own, then each engine
    compares what it holds with what its trainer rank sent. exact_check(started)
    waits for the verdict."""
    verdict: concurrent.futures.Future = concurrent.futures.Future()
    _running_checks.add(verdict)

    def check() -> None:
        try:
            verdict.set_result(_exact_check(job))
        except BaseException as e:  # re-raised in the round, by exact_check
            verdict.set_exception(e)
        finally:
            _running_checks.discard(verdict)

    threading.Thread(target=check, name="exact-check", daemon=True).start()
    return verdict


def settle_exact_checks(timeout_s: float = 30) -> None:
    """Wait, up to `timeout_s`, for exact checks still running beside a
    round that failed (or was interrupted) before taking their verdict: they
    call the trainers and the server, and must be done before the job leaves
    Ray (a Ray call after ray.shutdown() would start a new local Ray)."""
    concurrent.futures.wait(list(_running_checks), timeout=timeout_s)


def exact_check(started: concurrent.futures.Future) -> ExactCheck:
    """The verdict of the exact check start_exact_check started;
    `wait_seconds`: how long the round waited for it."""
    waited = time.perf_counter()
    result = started.result()
    result.wait_seconds = time.perf_counter() - waited
    return result


def _exact_check(job) -> ExactCheck:
    """Each trainer rank fingerprints what it sent (from its own model's
    shards, where a tensor is one model tensor); each DP engine compares that
    with what it holds, per parameter, on its GPU."""
    start = time.perf_counter()
    measured(job.trainers, "start_sent_fingerprints")
    helpers.collective_rpc(job.server.socket_path, "exact_check_start")
    sums = rank_fingerprints(measured(job.trainers, "sent_fingerprints"))
    trainer_seconds = time.perf_counter() - start
    expected = json.dumps(dict(zip(job.gpu_uuids, sums, strict=True)))
    try:
        answer = helpers.collective_rpc(job.server.socket_path, "exact_check", expected)[0]
    except helpers.ServerError as e:  # the engine's own words, out of the HTTP error's JSON
        text = str(e)
        if (at := text.find("exact check: ")) >= 0:
            text = text[at + len("exact check: ") :].split('"', 1)[0]
        return ExactCheck(False, time.perf_counter() - start, None, job.dp_size, text[:2000], trainer_seconds)
    return ExactCheck(
        True,
        time.perf_counter() - start,
        answer["parameters"],
        job.dp_size,
        None,
        trainer_seconds,
        answer.get("seconds"),
    )


# ---------------------------------------------------------------------------
# Rounds, the run, the summary
# ---------------------------------------------------------------------------


@dataclass
class GPUMemory:
    """One GPU after a sync, GiB."""

    trainer_peak_allocated: float  # the trainer's peak since the previous reading (this round)
    trainer_reserved: float
    server_used: float  # the vLLM server's processes on this GPU (NVML; every other process if its group is unknown); NaN if unknown
    device_used: float  # all processes, this job's and any other's
    job_used: float = math.nan  # this trainer rank's process and the server's on this GPU (NVML); NaN if unknown


@dataclass
class RoundRecord:
    """One round, as it goes into the JSON (the field names are the keys)."""

    phases_s: dict[str, float]
    send_breakdown_s: list[dict]  # per rank: RankMeasurement.send_breakdown
    cycle_s: float  # the sync phases, without a train step
    bytes_sent: int  # the model's bf16 size, whichever loader moves it
    send_gb_per_s: float  # bytes_sent / send
    bytes_per_gpu: int  # what each GPU's engine received (the direct loader: its own experts only)
    gpu_receive_gb_per_s: float  # bytes_per_gpu / send
    max_abs_dlogp_before: float
    mean_abs_dlogp_before: float
    max_abs_dlogp_after: float
    mean_abs_dlogp_after: float  # the worst DP engine's mean, the gated number
    max_abs_dlogp_after_per_dp_rank: list[float]
    mean_abs_dlogp_after_per_dp_rank: list[float]
    weights_updated: bool
    logprobs_changed: bool  # on every DP engine
    logprobs_changed_per_dp_rank: list[bool]
    gate_passed: bool
    mem_reserved_gib: list[float]
    memory_gib_per_rank: list[dict]
    send_retries: int = 0  # sends the server failed part way and that were sent again
    quantile_abs_dlogp_before: float | None = None  # the QUANTILE of |dlogp| over the tokens, worst engine
    quantile_abs_dlogp_after: float | None = None
    quantile_abs_dlogp_after_per_dp_rank: list[float] | None = None
    gate_tolerances: dict | None = None  # as applied: mean, quantile, max, and whether the noise set them
    change_test: dict | None = None  # after a step: did vLLM follow the trainer's change (ChangeTest)
    exact_check: dict | None = None  # ExactCheck: every engine holds, bit for bit, what was sent
    # With --train only:
    reward_mean: float | None = None
    loss: float | None = None
    step_skipped: str | None = None  # why no step was taken
    unchanged_by_step: list[str] | None = None  # trainer parameters the step left as they were

    def to_json(self) -> dict:
        optional = ("reward_mean", "loss", "step_skipped", "unchanged_by_step")
        return {k: v for k, v in asdict(self).items() if v is not None or k not in optional}


def round_record(
    phases: dict[str, float],
    send_per_rank: list[dict],
    sync_bytes: dict[str, int],
    before: LogprobGap,
    after: LogprobGap,
    result: Gate,
    memory: list[GPUMemory],
    weights_updated: bool,
) -> RoundRecord:
    send_s = phases["send"]
    return RoundRecord(
        phases_s=phases,
        send_breakdown_s=send_per_rank,
        cycle_s=sum(phases[p] for p in SYNC_PHASES),
        bytes_sent=sync_bytes["model"],
        send_gb_per_s=sync_bytes["model"] / send_s / 1e9,
        bytes_per_gpu=sync_bytes["per_gpu"],
        gpu_receive_gb_per_s=sync_bytes["per_gpu"] / send_s / 1e9,
        max_abs_dlogp_before=before.max,
        mean_abs_dlogp_before=before.mean,
        max_abs_dlogp_after=after.max,
        mean_abs_dlogp_after=after.mean,
        max_abs_dlogp_after_per_dp_rank=after.max_per_dp_rank,
        mean_abs_dlogp_after_per_dp_rank=after.mean_per_dp_rank,
        weights_updated=weights_updated,
        logprobs_changed=all(result.changed_per_dp_rank),
        logprobs_changed_per_dp_rank=result.changed_per_dp_rank,
        gate_passed=result.passed,
        mem_reserved_gib=[m.trainer_reserved for m in memory],
        memory_gib_per_rank=[asdict(m) for m in memory],
        quantile_abs_dlogp_before=before.quantile,
        quantile_abs_dlogp_after=after.quantile,
        quantile_abs_dlogp_after_per_dp_rank=after.quantile_per_dp_rank,
        change_test=asdict(result.change) if result.change else None,
    )


def judged_round(
    args,
    trainers: list,
    phases: dict[str, float],
    before: LogprobGap,
    after: LogprobGap,
    send_retries: int,
    weights_updated: bool,
    exact: ExactCheck | None = None,
    noise: LogprobGap | None = None,
    training: dict | None = None,
    server_pgids: list | None = None,
    kernel_noise: KernelNoise | None = None,
) -> RoundRecord:
    """A round as the JSON records it, with the checks' verdicts (printed):
    `phases` as measured, each rank's send_breakdown, the logprob gaps before and
    after the sync (`noise`: the gap on identical weights, if this round
    measured it: its `before`), the exact check, and with --train `training`
    = {"reward_mean", "loss"} (loss None when no step was taken);
    `server_pgids` as `memory` takes them; `kernel_noise` as measured before
    the first sync. The round
    passes only if the gate and the exact check both pass (failed_checks)."""
    tolerances = Tolerances.from_args(args, kernel_noise)
    stepped = training is not None and training["loss"] is not None
    verdict = gate(before, after, tolerances, weights_updated, noise=noise, stepped=stepped)
    synced = measured(trainers[:1], "sync_bytes")[0]
    send_per_rank = measured(trainers, "send_breakdown")
    record = round_record(
        phases, send_per_rank, synced, before, after, verdict, memory(trainers, server_pgids), weights_updated
    )
    record.send_retries = send_retries
    widened = (verdict.mean_tolerance, verdict.quantile_tolerance) != (tolerances.mean, tolerances.quantile)
    record.gate_tolerances = {
        "mean": verdict.mean_tolerance,
        "quantile": verdict.quantile_tolerance,
        "max": tolerances.max,
        "from_noise": widened,
    }
    if exact is not None:
        record.exact_check = asdict(exact)
    if training is not None:
        record.reward_mean, record.loss = training["reward_mean"], training["loss"]
        if training["loss"] is None:
            record.step_skipped = "every sample had the same reward: a step would change nothing"
        else:
            record.unchanged_by_step = measured(trainers[:1], "unchanged_by_last_step")[0]
    print_round(record, tolerances)
    return record


class RoundProof:
    """One round's proof and measurement, from outside the round: the round
    calls it at its named steps (`generated` with the batch both sides score,
    `step` around each phase, `trained` after the step), and `verdict()`,
    once the round is done, runs the exact check beside the gate and returns
    the round's record. `first_sync`: vLLM still holds its dummy weights;
    `previous`: the previous round's record, if any ([] or [record])."""

    def __init__(self, job, args, first_sync: bool, previous: list[RoundRecord] = ()) -> None:
        self.job, self.args, self.first_sync = job, args, first_sync
        # Did the previous sync pass the exact check? Then vLLM held the trainer's weights bit for bit.
        self.proven = any(r.exact_check and r.exact_check["passed"] for r in previous)
        self.timer = PhaseTimer()
        self.sequences: list[list[int]] = []
        self.before: LogprobGap | None = None
        self.training: dict | None = None
        self.send_retries = 0  # what send_all returned: sends the server failed part way and that were sent again

    def generated(self, batch: list[helpers.Completion]) -> None:
        """The tokens the trainer and every DP engine score, before and after the sync."""
        self.sequences = [c.prompt_token_ids + c.token_ids for c in batch]
        self.before = job_logprob_gap(self.job, self.sequences)

    def step(self, name: str):
        """`with proof.step("send"): ...`: the phase timed (PhaseTimer)."""
        return self.timer.phase(name)

    def trained(self, reward_mean: float, loss: float | None) -> None:
        """With --train: the batch's mean reward and the step's loss (None: no step was taken)."""
        self.training = {"reward_mean": reward_mean, "loss": loss}

    def verdict(self) -> RoundRecord:
        """The exact check (in a thread of its own, beside the gate; with TP
        each engine holds shards, not checked) and the gate: vLLM now scores
        the batch as the trainer does. If the previous sync was proven exact,
        vLLM held the trainer's weights bit for bit when `before` was
        measured: the change test's reference (never the gate's tolerance,
        which only the trainer's own noise widens)."""
        job, args = self.job, self.args
        started = start_exact_check(job) if args.tensor_parallel_size == 1 else None
        after = job_logprob_gap(job, self.sequences)
        exact = exact_check(started) if started is not None else None
        stepped = self.training is not None and self.training["loss"] is not None
        return judged_round(
            args,
            job.trainers,
            self.timer.seconds,
            self.before,
            after,
            self.send_retries,
            weights_updated=self.first_sync or stepped,
            exact=exact,
            noise=self.before if self.proven else None,
            training=self.training,
            server_pgids=job.server_pgids,
            kernel_noise=job.kernel_noise,
        )


def print_round(record: RoundRecord, tolerances: Tolerances) -> None:
    exact = record.exact_check
    if exact is not None:
        engines = f"{exact['dp_engines']} DP engine" + ("s" if exact["dp_engines"] != 1 else "")
        split = (
            f": trainers {exact['trainer_seconds']:.2f} s, engine 0 {exact['engine_seconds']:.2f} s"
            if exact.get("engine_seconds") is not None
            else ""
        )
        if exact.get("wait_seconds") is not None:
            split = f" beside the gate{split}; the round waited {exact['wait_seconds']:.3f} s for it"
        print(
            f"[exact] {exact['parameters_per_engine']} vLLM parameters on each of {engines} "
            f"hold what the trainer sent, bit for bit ({exact['seconds']:.2f} s{split})"
            if exact["passed"]
            else f"[exact] FAIL: {exact['problem']}",
            flush=True,
        )
    changed = f"vLLM logprobs changed on {sum(record.logprobs_changed_per_dp_rank)} of "
    changed += f"{len(record.logprobs_changed_per_dp_rank)} DP engines"
    if record.weights_updated and not record.logprobs_changed:
        changed += (
            " although the weights were updated (a sync that did nothing there, or a step too "
            "small to change a bf16 weight)"
        )
    extra = f", reward {record.reward_mean:.3f}" if record.reward_mean is not None else ""
    if record.change_test:
        c = record.change_test
        extra += (
            f", step's change {c['trainer_change_rms']:.4f} rms (noise {c['noise_rms']:.4f}): vLLM "
            f"{c['verdict']}" + (f" (residual {c['residual_rms']:.4f})" if c["verdict"] != "too small to see" else "")
        )
    if record.send_retries:
        extra += f", after {record.send_retries} retried send(s)"
    if record.unchanged_by_step:
        extra += f", {len(record.unchanged_by_step)} parameters unchanged by the step"
    tol = record.gate_tolerances or {"mean": tolerances.mean, "quantile": tolerances.quantile, "from_noise": False}
    basis = " from the trainer's kernel noise" if tol["from_noise"] else ""
    print(
        f"[gate] |dlogp| mean {record.mean_abs_dlogp_before:.4f} before -> "
        f"{record.mean_abs_dlogp_after:.4f} after, worst engine (tolerance {tol['mean']:.4g}{basis}), "
        f"p{QUANTILE * 100:.0f} {record.quantile_abs_dlogp_before:.4f} -> {record.quantile_abs_dlogp_after:.4f} "
        f"(tolerance {tol['quantile']:.4g}), max {record.max_abs_dlogp_after:.4f}, {changed}{extra}: "
        f"{'pass' if record.gate_passed else 'FAIL'}",
        flush=True,
    )


def memory_growth_gib(rounds: list[RoundRecord]) -> float:
    """Largest growth, on any GPU, of the memory this job's processes use
    after a sync (all processes', where NVML cannot tell), from round 2 to the last round. Round 1 is left out: it allocates
    what every later round reuses (optimizer state, IPC buffer, NCCL buffers)."""
    if len(rounds) < 3:
        return 0.0
    first, last = rounds[1].memory_gib_per_rank, rounds[-1].memory_gib_per_rank

    def used(m: dict) -> float:  # this job's processes where NVML tells them apart: other jobs may share the GPU
        return m["job_used"] if math.isfinite(m.get("job_used", math.nan)) else m["device_used"]

    return max(used(b) - used(a) for a, b in zip(first, last, strict=True))


def failed_checks(result: dict, memory_tolerance_gib: float) -> list[str]:
    failures = [f"round {i}: logprob gate" for i, r in enumerate(result["rounds"], 1) if not r["gate_passed"]]
    failures += [
        f"round {i}: exact check: {r['exact_check']['problem']}"
        for i, r in enumerate(result["rounds"], 1)
        if r.get("exact_check") and not r["exact_check"]["passed"]
    ]
    failures += [
        f"round {i}: the step left {len(r['unchanged_by_step'])} trainer parameters unchanged, "
        f"e.g. {r['unchanged_by_step'][:3]}"
        for i, r in enumerate(result["rounds"], 1)
        if r.get("unchanged_by_step")
    ]
    if result["coverage"] and result["coverage"]["unwritten"]:
        failures.append(f"the sync did not write {len(result['coverage']['unwritten'])} vLLM parameters")
    if not result["memory_growth_gib"] <= memory_tolerance_gib:
        failures.append(
            f"GPU memory grew {result['memory_growth_gib']:.2f} GiB from round 2 to the last "
            f"(tolerance {memory_tolerance_gib} GiB)"
        )
    return failures


def run_result(args, job, rounds: list[RoundRecord], coverage: dict | None, time_to_first_sync_s: float) -> dict:
    """The run's JSON: how it was run, then what it measured."""
    return {
        **run_facts(args, job),
        "train": args.train,
        "kernel_noise": asdict(job.kernel_noise) if job.kernel_noise else None,
        "time_to_first_sync_s": time_to_first_sync_s,
        "coverage": coverage,
        "rounds": [r.to_json() for r in rounds],
        "memory_gib_per_rank": rounds[-1].memory_gib_per_rank,
        "memory_growth_gib": memory_growth_gib(rounds),
        "retried_rounds": [i for i, r in enumerate(rounds, 1) if r.send_retries],
    }


def report(args, result: dict) -> int:
    """Print the summary, write the JSON (--json), name every failed check;
    the exit code: 1 if any failed."""
    print(format_summary(result))
    if args.json:
        write_json(args.json, result)
        print(f"[json] {args.json}")
    failures = failed_checks(result, args.memory_growth_tolerance_gib)
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


def run_facts(args, job) -> dict:
    """What a reader needs to reproduce a result: hardware, versions, command, settings."""
    import vllm

    return {
        "gpu_name": job.gpu_name,
        "num_gpus": args.num_gpus,
        "num_nodes": args.num_nodes,
        "rank_nodes": job.rank_nodes,  # each trainer rank's Ray node id
        "tensor_parallel_size": args.tensor_parallel_size,
        "data_parallel_size": job.dp_size,
        "model": args.model,
        "architecture": job.architecture,
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%d"),
        "weight_loader": args.weight_loader,
        "rollout_dtype": args.rollout_dtype,  # what vLLM serves the routed experts in
        "packed": args.packed,
        "packed_buffer_size_bytes": args.packed_buffer_size_bytes,
        "sleep_level": args.sleep_level,
        "free_kv_cache": args.free_kv_cache,  # as given: None is "with --train"
        "server_start_s": job.server.healthy_after_s,
        "weights_in_after_s": job.weights_in_after_s,  # seconds into the server's start (they overlap)
        "checkpoint_bytes_read_per_rank": job.checkpoint_bytes_read_per_rank,
        "experts_in_place": job.experts_in_place,  # direct loader: the engines copied them from the trainers' memory
        # How vLLM's own loader reloads (vLLM >= 0.34 reads this from the server's environment;
        # "direct": in place; earlier versions reload layer by layer only).
        "vllm_reload_mode": os.environ.get("VLLM_RELOAD_MODE", "layerwise"),
    }


def _nan_to_null(value):
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _nan_to_null(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_nan_to_null(v) for v in value]
    return value


def write_json(path: str | os.PathLike, result: dict) -> None:
    """Strict JSON: NaN (a number nobody could measure) is written as null."""
    Path(path).write_text(json.dumps(_nan_to_null(result), indent=2, allow_nan=False) + "\n")


def format_summary(result: dict) -> str:
    """A plain-text table of a run's JSON result."""
    train, nodes = result.get("train", False), result.get("num_nodes", 1)
    gpus = f"{result['num_gpus']} x {result['gpu_name']}" + (f" on {nodes} nodes" if nodes > 1 else "")
    lines = [
        f"model {result['model']} ({result['architecture']}) | {gpus} | "
        f"vLLM {result['vllm_version']} | server start {result['server_start_s']:.1f} s",
        "",
        "round | "
        + " | ".join(f"{p:>12}" for p in SYNC_PHASES)
        + " |    cycle | GB per GPU |   GB/s | mean|dlogp| before -> after | max after | changed | gate | exact"
        + (" |    train | reward" if train else ""),
    ]
    for i, r in enumerate(result["rounds"], 1):
        ph = r["phases_s"]
        line = (
            f"{i:>5} | "
            + " | ".join(f"{ph[p]:>10.3f} s" for p in SYNC_PHASES)
            + f" | {r['cycle_s']:>6.2f} s | {r['bytes_per_gpu'] / 1e9:>10.3f} | "
            f"{r['gpu_receive_gb_per_s']:>6.2f} | {r['mean_abs_dlogp_before']:>14.4f} -> "
            f"{r['mean_abs_dlogp_after']:<8.4f} | {r['max_abs_dlogp_after']:>9.4f} | "
            f"{'yes' if r['logprobs_changed'] else 'no':>7} | "
            f"{'pass' if r['gate_passed'] else 'FAIL'} | "
            f"{'-' if not r.get('exact_check') else 'pass' if r['exact_check']['passed'] else 'FAIL':>5}"
        )
        if train:
            reward = f"{r['reward_mean']:.3f}" if "reward_mean" in r else "-"
            line += f" | {ph.get('train', 0.0):>6.2f} s | {reward}"
        lines.append(line)
    lines += ["", "GPU | trainer peak alloc | trainer reserved | server (NVML) | GPU used (all processes)"]
    for rank, m in enumerate(result["memory_gib_per_rank"]):
        lines.append(
            f"{rank:>3} | {m['trainer_peak_allocated']:>14.2f} GiB | "
            f"{m['trainer_reserved']:>12.2f} GiB | {m['server_used']:>9.2f} GiB | "
            f"{m['device_used']:>10.2f} GiB"
        )
    if len(result["rounds"]) >= 3:
        lines.append(f"GPU memory growth, round 2 -> last: {result['memory_growth_gib']:+.3f} GiB")
    if result.get("time_to_first_sync_s") is not None:
        lines.append(f"time to the first gated sync: {result['time_to_first_sync_s']:.1f} s")
    if result.get("weights_in_after_s") is not None:
        read = max(result.get("checkpoint_bytes_read_per_rank") or [0])
        size = f"{read / 1e9:.2f} GB" if read >= 1e8 else f"{read / 1e6:.2f} MB"
        source = f"the checkpoint, {size} read per rank" if read else "random"
        lines.append(f"trainer weights ({source}) in {result['weights_in_after_s']:.0f} s into the server's start")
    if result.get("retried_rounds"):
        lines.append(f"rounds whose send was retried: {result['retried_rounds']}")
    return "\n".join(lines)


def show_layout(placements: list[dict], num_nodes: int) -> None:
    """Print which node and GPUs each node's trainer ranks have (ranks in
    node order, as many on each node)."""
    per_node = len(placements) // num_nodes
    for k in range(num_nodes):
        ranks = placements[k * per_node : (k + 1) * per_node]
        print(
            f"[trainers] node {k} ({ranks[0]['node_ip']}, Ray node {ranks[0]['node'][:8]}): ranks "
            f"{ranks[0]['rank']}-{ranks[-1]['rank']} on GPUs {[p['gpu_ids'][0] for p in ranks]} "
            f"({ranks[0].get('gpu_name', 'no GPU')})",
            flush=True,
        )


def show_texts(label: str, prompts: list[str], batch: list[helpers.Completion]) -> None:
    print(f"--- {label} ---", *(f"{p!r} -> {c.text!r}" for p, c in zip(prompts, batch, strict=True)), sep="\n")


class PhaseTimer:
    """Wall-clock seconds per named phase: `with timer.phase("sleep"): ...`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str):
        print(f"[{name}] ...", flush=True)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = time.perf_counter() - start
            print(f"[{name}] {self.seconds[name]:.2f} s", flush=True)


# ---------------------------------------------------------------------------
# Measurement: the trainer, timed and inspected from outside its code
# ---------------------------------------------------------------------------
#
# The script's trainer is FSDPTrainer as a user writes one. `measure` wraps,
# in every rank, what a sync goes through: the sender's weight source (timed,
# fingerprinted for the exact check) and its client (timed), the send itself
# (timed), and the optimizer (which parameters a step left as they were). The
# driver reads the results with `measured`. The functions after
# RankMeasurement run in a rank through `__ray_call__`, on any trainer with a
# `model` and a `device`.


def measure(trainers: list) -> None:
    """On every rank, once setup_weight_transfer has built its sender
    (`trainer.sender`): RankMeasurement. Again after each new setup."""
    helpers.ray_get_all([t.__ray_call__.remote(_start_measuring) for t in trainers])


def _start_measuring(trainer) -> None:
    trainer.measurement = RankMeasurement(trainer)


def measured(trainers: list, method: str, *args) -> list:
    """RankMeasurement.<method>(*args) on every rank of `trainers`."""
    return helpers.ray_get_all([t.__ray_call__.remote(_measurement_call, method, *args) for t in trainers])


def _measurement_call(trainer, method: str, *args):
    return getattr(trainer.measurement, method)(*args)


class RankMeasurement:
    """One rank's sends and steps, measured (measure): its WeightSender built
    again around a timed, fingerprinted source and a timed client, its sends
    timed (TimedSender), its optimizer's steps watched (StepWatch)."""

    def __init__(self, trainer) -> None:
        sender, self.device, self.model = trainer.sender, trainer.device, trainer.model
        if isinstance(sender, TimedSender):  # measured already, and no new setup since: around the trainer's own
            sender = sender.unmeasured
        self.send_seconds: dict[str, float] = {}
        self.sent_source = sender.source  # for the exact check: what this rank sends
        self.fingerprinted = FingerprintedSource(TimedSource(sender.source, self.send_seconds))
        measured = helpers.weight_sender(
            sender.rank,
            TimedClient(sender.client.client, self.send_seconds),
            self.fingerprinted,
            sender.packed,
            sender.packed_buffer_size_bytes,
        )
        trainer.sender = TimedSender(measured, self.send_seconds, self.device, unmeasured=sender)
        if getattr(trainer, "optimizer", None) is not None and not isinstance(trainer.optimizer, StepWatch):
            trainer.optimizer = StepWatch(trainer.optimizer, trainer.model, self.device)
        self.optimizer = getattr(trainer, "optimizer", None)

    def sent_metadata(self) -> list[list]:
        """[name, dtype, shape, is an expert block] of every tensor this rank
        sends, in send order (expert blocks: LocalExpertSource's own experts)."""
        blocks = getattr(self.sent_source, "expert_blocks", {})
        return [
            [m.name, str(m.dtype).removeprefix("torch."), list(m.shape), m.name in blocks]
            for m in self.sent_source.metadata
        ]

    def start_sent_fingerprints(self) -> None:
        """Start sent_fingerprints' kernels, to run beside what comes next."""
        self.fingerprinted.start()

    def sent_fingerprints(self) -> dict:
        """exact_check_engine.exact_fingerprint of every tensor this rank sent
        in its last send, in send order, on its GPU, from its own model where
        it can (FingerprintedSource.fingerprints; rank_fingerprints adds the shards up)."""
        return self.fingerprinted.fingerprints()

    def set_exact_casts(self, casts: dict[int, str], rows: dict[int, int] | None = None) -> None:
        """Which sent tensors vLLM holds in another dtype, and the row of its
        parameter each piece of a stacked one lands at (exact_check_prepare).
        Also fingerprints a few rows of each dtype and width it will send, so
        that Triton compiles most of its kernels now rather than in the first
        sync (seconds; it specializes on a few more of their arguments)."""
        self.fingerprinted.casts, self.fingerprinted.rows = casts, rows or {}
        kinds = {
            (casts.get(i, dtype), tuple(shape[-1:]) if len(shape) > 1 else ())
            for i, (_, dtype, shape, _) in enumerate(self.sent_metadata())
            if not casts.get(i, "").startswith(exact_check_engine.FP8_BLOCKS)
        }
        exact_check_engine.exact_fingerprints(
            torch.zeros(16, *width, dtype=getattr(torch, dtype), device=self.device) for dtype, width in kinds
        )

    def send_breakdown(self) -> dict[str, float]:
        """Where this rank's last send went: `source` (producing the tensors:
        host time, see TimedSource), `server_*` (waiting on the server, rank 0
        only) and `engine_*` (the direct loader's own split of DP engine 0's
        part of that), `total`; the rest is packing, the GPU's gathers and
        the trainer ranks' handshakes."""
        return dict(self.send_seconds)

    def sync_bytes(self) -> dict[str, int]:
        return sync_bytes(self.model, self.sent_source)

    def unchanged_by_last_step(self) -> list[str]:
        """The parameters the last optimizer step left exactly as they were."""
        return self.optimizer.unchanged if isinstance(self.optimizer, StepWatch) else []


def sync_bytes(model: torch.nn.Module, source) -> dict[str, int]:
    """The model's bf16 bytes, and what one sync puts in each GPU's engine (`source`: a rank's)."""
    return {
        "model": sum(p.numel() * torch.bfloat16.itemsize for p in model.parameters()),
        "per_gpu": sum(math.prod(m.shape) * m.dtype.itemsize for m in source.metadata),
    }


class TimedSender:
    """A WeightSender whose send() adds its whole time to `seconds["total"]`,
    the device synchronised (what send_breakdown reads), after clearing the
    last send's numbers."""

    def __init__(self, sender, seconds: dict[str, float], device: torch.device, unmeasured=None) -> None:
        self._sender, self._seconds, self._device = sender, seconds, device
        self.unmeasured = unmeasured  # the trainer's own sender, which `sender` was built around (RankMeasurement)

    def send(self) -> None:
        self._seconds.clear()
        start = time.perf_counter()
        self._sender.send()
        _synchronize(self._device)
        self._seconds["total"] = time.perf_counter() - start

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._sender, name)


class StepWatch:
    """An optimizer whose step() also records which parameters it left
    exactly as they were on every rank's shard (`unchanged`): a step that
    cannot reach a parameter (no gradient, a frozen weight) would otherwise
    pass unseen. It compares shards with shards: the optimizer's own
    parameters, each rank's FSDP2 shard."""

    def __init__(self, optimizer, model: torch.nn.Module, device: torch.device) -> None:
        self._optimizer, self._device = optimizer, device
        if hasattr(model, "reshard"):  # after a forward, FSDP2 may hold the root's own parameters unsharded
            model.reshard()
        names = {id(p): n for n, p in model.named_parameters()}
        self._params = [p for group in optimizer.param_groups for p in group["params"]]
        self._names = [names.get(id(p), f"(optimizer parameter {i})") for i, p in enumerate(self._params)]
        self.unchanged: list[str] = []

    def step(self, *args, **kwargs):
        before = parameter_fingerprints(self._params)
        result = self._optimizer.step(*args, **kwargs)
        after = parameter_fingerprints(self._params)
        changed = torch.tensor(
            [a != b for a, b in zip(after, before, strict=True)], dtype=torch.int32, device=self._device
        )
        if dist.is_initialized():
            dist.all_reduce(changed, op=dist.ReduceOp.MAX)  # changed on any rank's shard
        self.unchanged = [n for n, c in zip(self._names, changed.tolist(), strict=True) if not c]
        return result

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._optimizer, name)


def parameter_fingerprints(params) -> list[list[int]]:
    """The exact fingerprint of each parameter's local shard (its elements'
    bits by position), so any change to any element shows. (A plain sum of
    the bits did not: an AdamW step can move a norm's few elements by amounts
    that cancel.)"""
    return exact_check_engine.exact_fingerprints(p.to_local() if hasattr(p, "to_local") else p for p in params)


def fp8_experts_logprobs(trainer, sequences: list[list[int]]) -> list[list[float]]:
    """In a rank: token_logprobs with the routed experts computing as vLLM's
    block-FP8 MoE kernel does: every fused expert tensor as vLLM serves it
    (this rank's block of experts quantized through vLLM's own function and
    back, in place) and the experts' activations quantized as that kernel
    quantizes them (fp8_experts_forward); then the weights put back from a
    copy in host memory and the experts' own forward back: what FP8 alone
    does to the trainer's log-probabilities."""
    params, saved = dict(trainer.model.named_parameters()), {}
    fused = sources.fused_expert_tensors(trainer.model)
    experts = {trainer.model.get_submodule(name.rpartition(".")[0]) for name in fused}
    try:
        with torch.no_grad():
            for name in fused:
                local = params[name].to_local() if hasattr(params[name], "to_local") else params[name]
                saved[name] = (local, local.detach().to("cpu", copy=True))
                local.copy_(fp8_dequantized(local.to(torch.bfloat16), 2 if name.endswith("gate_up_proj") else 1))
        for module in experts:
            module.forward = fp8_experts_forward(module)  # (an attribute of the object: over its class's forward)
        return trainer.token_logprobs(sequences)
    finally:
        for module in experts:
            module.__dict__.pop("forward", None)
        if hasattr(trainer.model, "reshard"):  # (a forward that failed part way may leave modules gathered)
            trainer.model.reshard()
        with torch.no_grad():
            for local, original in saved.values():
                local.copy_(original)


def fp8_experts_forward(experts: torch.nn.Module, activations=None):
    """A forward for a transformers fused experts module (gate_up_proj
    [experts, 2 x intermediate, hidden], down_proj [experts, hidden,
    intermediate], act_fn) that reads its input and the intermediate as
    vLLM's block-FP8 Triton MoE kernel does: through `activations`
    (default fp8_activations). The same arithmetic as the module's own loop
    otherwise."""
    quantized = fp8_activations if activations is None else activations

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for expert in top_k_index.unique().tolist():
            if expert >= experts.num_experts:  # (the index an expert-parallel model gives experts held elsewhere)
                continue
            token, slot = torch.where(top_k_index == expert)
            gate, up = torch.nn.functional.linear(quantized(hidden_states[token]), experts.gate_up_proj[expert]).chunk(
                2, dim=-1
            )
            down = torch.nn.functional.linear(quantized(experts.act_fn(gate) * up), experts.down_proj[expert])
            out.index_add_(0, token, (down * top_k_weights[token, slot, None]).to(out.dtype))
        return out

    return forward


def fp8_activations(x: torch.Tensor) -> torch.Tensor:
    """`x` as vLLM's block-FP8 MoE kernel reads an activation: each row's
    values in groups of 128 columns (the last one padded with zeros), each
    group quantized to e4m3 with the scale its largest magnitude / 448 (at
    least 1e-10 / 448, as per_token_group_quant_fp8), and back."""
    columns = x.shape[-1]
    padded = -(-columns // fp8_experts.FP8_BLOCK) * fp8_experts.FP8_BLOCK
    groups = torch.nn.functional.pad(x.float(), (0, padded - columns)).unflatten(-1, (-1, fp8_experts.FP8_BLOCK))
    scale = groups.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / 448.0
    back = (groups / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale
    return back.flatten(-2)[..., :columns].to(x.dtype)


def fp8_dequantized(block: torch.Tensor, shards: int) -> torch.Tensor:
    """An expert block ([experts, shards x rows, columns]) as vLLM serves it in
    FP8, back in float32: fp8_experts.fp8_reference's weight times its block
    scales, without the padding."""
    weight, scales = fp8_experts.fp8_reference(block, shards)
    block_size = fp8_experts.FP8_BLOCK
    values = weight.float() * scales.repeat_interleave(block_size, 1).repeat_interleave(block_size, 2)
    rows, step = block.shape[1] // shards, weight.shape[1] // shards
    return torch.cat([values[:, k * step : k * step + rows, : block.shape[2]] for k in range(shards)], dim=1)


def other_attention_logprobs(trainer, sequences: list[list[int]]) -> tuple[str, list[list[float]]] | None:
    """In a rank: token_logprobs through the other attention implementation
    (eager for SDPA or flash, SDPA for eager): a second correct bf16 forward
    of the same weights, for KernelNoise. None if the model refuses it."""
    current = trainer.model.config._attn_implementation
    other = "sdpa" if current == "eager" else "eager"
    try:
        trainer.model.set_attn_implementation(other)
    except (ValueError, ImportError):
        return None
    try:
        return f"{current} vs {other}", trainer.token_logprobs(sequences)
    finally:
        trainer.model.set_attn_implementation(current)


def memory_gib(trainer, server_pgid: int | None = None) -> GPUMemory:
    """In a rank: its GPU now, and the trainer's peak since the last reading;
    `server_pgid`: the process group of the vLLM server on this node."""
    device = trainer.device
    free, total = torch.cuda.mem_get_info(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    mine, server = nvml_gpu_memory(str(torch.cuda.get_device_properties(device).uuid), server_pgid)
    return GPUMemory(
        trainer_peak_allocated=peak / GiB,
        trainer_reserved=torch.cuda.memory_reserved(device) / GiB,
        server_used=server / GiB,
        device_used=(total - free) / GiB,
        job_used=(mine + server) / GiB if server_pgid is not None else math.nan,
    )


def device_copy_gb_per_s(trainer, size_bytes: int = 512 * 1024**2, repeats: int = 10) -> float:
    """In a rank: its device's copy rate, GB of one buffer copied into
    another per second (each byte read once and written once), the rate a
    sync that writes each weight once cannot beat (benchmark.with_floor)."""
    source = torch.empty(size_bytes, dtype=torch.uint8, device=trainer.device)
    target = torch.empty_like(source)
    target.copy_(source)  # (the first copy pays for the kernel's start)
    _synchronize(trainer.device)
    start = time.perf_counter()
    for _ in range(repeats):
        target.copy_(source)
    _synchronize(trainer.device)
    return repeats * size_bytes / (time.perf_counter() - start) / 1e9


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def server_pgids_per_rank(server, node_servers: list, num_gpus: int, num_nodes: int) -> list[int]:
    """For each rank, the process group of the vLLM server on its node (ranks
    go in node order), as `memory` takes them."""
    per_node = [server.pgid, *helpers.ray_get_all([s.pgid.remote() for s in node_servers], who="a node's server actor")]
    return [per_node[r // (num_gpus // num_nodes)] for r in range(num_gpus)]


def memory(trainers: list, server_pgids: list | None = None) -> list[GPUMemory]:
    """Each rank's GPU (`server_pgids`: per rank, its node's server's process group)."""
    return ray.get(
        [t.__ray_call__.remote(memory_gib, server_pgids[r] if server_pgids else None) for r, t in enumerate(trainers)]
    )


def nvml_gpu_memory(gpu_uuid: str, server_pgid: int | None = None) -> tuple[float, float]:
    """(bytes this process uses on the GPU with this UUID, bytes the server's
    processes use there: those of process group `server_pgid`, or every other
    process if None), from NVML; NaN where NVML cannot tell."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            uuid = gpu_uuid if gpu_uuid.startswith("GPU-") else f"GPU-{gpu_uuid}"
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            procs = [(p.pid, p.usedGpuMemory or 0) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)]
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML, no permission
        return math.nan, math.nan
    return split_gpu_memory(procs, os.getpid(), server_pgid)


def split_gpu_memory(procs: list[tuple[int, int]], me: int, server_pgid: int | None, getpgid=os.getpgid):
    """nvml_gpu_memory's (mine, the server's) from NVML's (pid, bytes) list."""
    if me not in {pid for pid, _ in procs}:
        return math.nan, math.nan  # NVML sees another PID namespace: it cannot tell us apart

    def servers(pid: int) -> bool:
        if server_pgid is None:
            return True
        try:
            return getpgid(pid) == server_pgid
        except OSError:  # gone, or on another node
            return False

    mine = float(sum(used for pid, used in procs if pid == me))
    return mine, float(sum(used for pid, used in procs if pid != me and servers(pid)))


class SourceWrapper(TrainerSource):
    """A weight source around another: the same tensors and metadata, and
    anything else the source offers (e.g. expert_blocks)."""

    def __init__(self, source: TrainerSource) -> None:
        self._source = source

    def param_metas(self):
        return self._source.metadata

    def tensors(self):
        return self._source.tensors()

    def __getattr__(self, name: str):
        if name.startswith("_"):  # not yet set (a copy being built): not the source's either
            raise AttributeError(name)
        return getattr(self._source, name)


class FingerprintedSource(SourceWrapper):
    """The exact check's half on the trainer: the fingerprint (exact_check_engine's,
    on the tensor's device, cast first to the dtype vLLM holds it in where
    `casts` says so) of every tensor a send takes. A tensor that is one model
    tensor cast (the source's `origins`: most of them) is fingerprinted after
    the send from the model itself, each rank its own FSDP shard where the
    shards add up to it (`partial`), from the second send on every kernel from
    one CUDA graph (exact_check_engine.HeldFingerprints; eagerly where --train's fp32
    masters are cast first): nothing is added to the send, and what is
    proved reaches back to the trainer's own parameters. The rest (a
    conversion's output) is fingerprinted as the send takes it, the kernels
    queued before the send's own copy of the tensor. An expert's tensor cut
    from a fused expert tensor (vLLM's loader) is one of the former: its
    slice of the model's tensor, by the rank that holds that expert, so a
    conversion that cuts or names it wrong fails the check. Each tensor is
    fingerprinted at the row of its vLLM parameter it lands at (`rows`)."""

    def __init__(self, source: TrainerSource) -> None:
        super().__init__(source)
        self.casts: dict[int, str] = {}  # from exact_targets: index in send order -> dtype name
        self.rows: dict[int, int] = {}  # from piece_rows: index -> the row of its parameter it lands at
        self._sums: dict[int, torch.Tensor] = {}  # index -> sums taken in the send
        self._from_model: dict[int, tuple] | None = None  # index -> (module, attribute, a rank's own block)
        self._held = exact_check_engine.HeldFingerprints()
        self._started = None  # what waits for the fingerprints start() launched
        self._partial: list[int] = []
        # index -> sums taken apart from the graph: an FP8 expert block's weight and scales; zeros where
        # a rank adds nothing to an expert's tensor (another rank holds that expert)
        self._apart: dict[int, torch.Tensor] = {}

    def tensors(self):
        if self._from_model is None:  # once, before the first send: the layout stays
            origins = getattr(self._source, "origins", None) or [None] * len(self.metadata)
            self._from_model = {i: o for i, o in enumerate(origins) if o and _shard_of(getattr(*o[:2]), o[2])}
        self._sums, self._started = {}, None  # a send that starts again (a retry) starts the fingerprints again
        for index, (name, tensor) in enumerate(self._source.tensors()):
            if index not in self._from_model:
                self._sums[index] = exact_check_engine.held_fingerprint_sums(
                    tensor, self.casts.get(index), self.rows.get(index, 0)
                )
            yield name, tensor

    def start(self) -> None:
        """Start fingerprinting, from the model, the tensors the last send
        took from it: on a GPU on a CUDA stream of its own, beside whatever
        the rank does next (fingerprints() waits for it)."""
        tensors, offsets, casts, self._partial, self._apart = [], [], [], [], {}
        nothing = None  # the sums of no element, shared by every expert another rank holds
        for index, (module, attribute, block, *piece) in (self._from_model or {}).items():
            if (shard := _shard_of(getattr(module, attribute), block)) is None:
                raise RuntimeError(f"{self.metadata[index].name}: laid out otherwise than in the send")
            local, offset, is_partial = shard
            if piece:  # one expert's rows of a fused expert tensor: from the rank that holds that expert
                (_, first, rows), mine = piece[0], piece[0][0] - offset
                self._partial += [index] if is_partial else []
                if not 0 <= mine < local.shape[0]:  # another rank's expert: this rank adds nothing
                    nothing = nothing if nothing is not None else torch.zeros(3, dtype=torch.int64, device=local.device)
                    self._apart[index] = nothing
                    continue
                local, offset, is_partial = local[mine, first : first + rows], 0, False
            held = self.casts.get(index)
            if held and held.startswith(exact_check_engine.FP8_BLOCKS):  # a rank's own block, quantized as vLLM does
                self._apart[index] = exact_check_engine.held_fingerprint_sums(local, held)
                continue
            tensors.append(local)
            offsets.append(offset + self.rows.get(index, 0))
            casts.append(_casts(local.dtype, self.metadata[index].dtype, self.casts.get(index)))
            self._partial += [index] if is_partial else []
        self._started = self._held.start(tensors, offsets, casts)

    def fingerprints(self) -> dict:
        """{"sums": [plain, by_column, by_position] of each tensor the last
        send took, "partial": the indices where those are this rank's
        shard's, to be added up over the ranks (rank_fingerprints)}."""
        if self._started is None:
            self.start()
        started, self._started = self._started, None
        graphed = [i for i in (self._from_model or {}) if i not in self._apart]
        from_model = dict(zip(graphed, started(), strict=True))
        from_model.update(_read_back(self._apart))
        taken = _read_back(self._sums)
        return {
            "sums": [from_model[i] if i in from_model else taken[i] for i in range(len(self.metadata))],
            "partial": self._partial,
        }


def _read_back(sums: dict[int, torch.Tensor]) -> dict[int, list]:
    """{index: fingerprint sums on the device} -> {index: as lists}, one copy per shape (a tensor's
    [3], an FP8 block's [2, 3]) rather than a wait for the device per tensor."""
    out = {}
    for shape in {tuple(t.shape) for t in sums.values()}:
        same = [i for i, t in sums.items() if tuple(t.shape) == shape]
        out.update(zip(same, torch.stack([sums[i] for i in same]).cpu().tolist()))
    return out


def _casts(held: torch.dtype, sent: torch.dtype, vllm_holds: str | None) -> tuple[torch.dtype, ...]:
    """The casts from a model tensor (`held` by the trainer) to what vLLM
    holds of it: to the dtype it is `sent` in, then to the one vLLM keeps it
    in (`vllm_holds`, a dtype's name, if another); only those that change it,
    since a tensor cast first cannot be fingerprinted from a CUDA graph."""
    out, dtype = [], held
    for target in (sent, getattr(torch, vllm_holds) if vllm_holds else sent):
        if target != dtype:
            out.append(target)
            dtype = target
    return tuple(out)


def _shard_of(tensor: torch.Tensor, block: bool) -> tuple[torch.Tensor, int, bool] | None:
    """(this rank's part of a model tensor, the row of dim 0 it starts at in
    the whole, whether the ranks' parts make up the whole): all of it if it is
    not sharded or is a rank's own block; its FSDP2 shard if dim 0 is split
    over all ranks. None for another layout (then it is fingerprinted in the send)."""
    if not hasattr(tensor, "to_local"):
        return tensor.detach(), 0, False
    local, mesh, placements = tensor.to_local().detach(), tensor.device_mesh, tensor.placements
    if block or mesh.size() == 1 or all(p.is_replicate() for p in placements):
        return local, 0, False
    world = dist.get_world_size() if dist.is_initialized() else 1
    if mesh.ndim != 1 or not placements[0].is_shard(0) or mesh.size() != world:
        return None
    rows = tensor.shape[0]
    return local, min(mesh.get_local_rank() * -(-rows // mesh.size()), rows), True  # torch.chunk's split


def rank_fingerprints(reports: list[dict]) -> list[list[list[int]]]:
    """Each rank's fingerprints of what it sent, from every rank's
    FingerprintedSource.fingerprints(): where a rank fingerprinted its shard
    of a tensor every rank sends whole, the sum of all ranks' shards."""
    partial = set(reports[0]["partial"]) if reports else set()
    modulus = exact_check_engine.FINGERPRINT_MODULUS
    whole = {i: [sum(column) % modulus for column in zip(*(r["sums"][i] for r in reports))] for i in partial}
    return [[whole.get(i, sums) for i, sums in enumerate(r["sums"])] for r in reports]


class TimedSource(SourceWrapper):
    """A weight source that adds the seconds spent producing its tensors to
    seconds["source"]: host time (FSDP's gathers and the casts are launched
    here; the GPU runs them while the next ones are launched). Waiting for the
    device after every tensor would time the GPU's part too, but it would also
    stall the send 400+ times a sync, so the measurement would slow down what
    it measures. The send's total is timed with the device synchronised."""

    def __init__(self, source: TrainerSource, seconds: dict[str, float]) -> None:
        super().__init__(source)
        self._seconds = seconds

    def tensors(self):
        items = self._source.tensors()
        while True:
            start = time.perf_counter()
            item = next(items, None)
            self._seconds["source"] = self._seconds.get("source", 0.0) + time.perf_counter() - start
            if item is None:
                return
            yield item


class TimedClient:
    """A weight sync client that adds the seconds spent in each of its calls
    (the server's share of a send, as the sender sees it) to `seconds`."""

    def __init__(self, client, seconds: dict[str, float]) -> None:
        self._client = client
        self._seconds = seconds

    def __getattr__(self, name: str):
        if name.startswith("_"):  # not yet set (a copy being built): not the client's either
            raise AttributeError(name)
        call = getattr(self._client, name)
        if not callable(call):  # an attribute (e.g. the direct loader client's experts_in_place): as it is
            return call

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                result = call(*args, **kwargs)
            finally:
                key = f"server_{name}"
                self._seconds[key] = self._seconds.get(key, 0.0) + time.perf_counter() - start
                self._seconds[f"{key}_calls"] = self._seconds.get(f"{key}_calls", 0) + 1
            # The direct loader says where the first engine's time went: kept
            # apart (engine_*), as a part of the server's share above.
            for part, seconds in (result.get("seconds", {}) if isinstance(result, dict) else {}).items():
                self._seconds[f"engine_{part}"] = self._seconds.get(f"engine_{part}", 0.0) + seconds
            return result

        return timed
