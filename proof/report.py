# SPDX-License-Identifier: Apache-2.0
"""Record and print a run's results.

RoundRecord is each round's record, whose field names are the JSON's keys, and print_round prints its lines.
show_layout prints the trainers' layout. run_result builds the run's JSON, format_summary its table, and
report names the failed checks and returns the exit code.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from proof.exact_accounting import NOT_COMPARED
from proof.logprob_gate import MEAN_CEILING, QUANTILE, QUANTILE_CEILING, Gate, KernelNoise, LogprobGap, Tolerances
from proof.memory import GPUMemory

SYNC_PHASES = ("sleep", "wake_weights", "send", "wake_kv")


@dataclass
class RoundRecord:
    """Hold one round as it goes into the JSON; the field names are the keys."""

    phases_s: dict[str, float]
    send_breakdown_s: list[dict]  # Per rank, from RankMeasurement.send_breakdown.
    cycle_s: float  # The sync phases, without a train step.
    bytes_sent: int  # The model's bf16 size, whichever loader moves it.
    send_gb_per_s: float  # bytes_sent / send
    bytes_per_gpu: int  # What each GPU's engine received; with the direct loader, only its own experts.
    gpu_receive_gb_per_s: float  # bytes_per_gpu / send
    max_abs_dlogp_before: float
    mean_abs_dlogp_before: float
    max_abs_dlogp_after: float
    mean_abs_dlogp_after: float  # The worst DP engine's mean, which is the gated number.
    max_abs_dlogp_after_per_dp_rank: list[float]
    mean_abs_dlogp_after_per_dp_rank: list[float]
    weights_updated: bool
    logprobs_changed: bool  # On every DP engine.
    logprobs_changed_per_dp_rank: list[bool]
    gate_passed: bool
    mem_reserved_gib: list[float]
    memory_gib_per_rank: list[dict]
    send_retries: int = 0  # Sends the server failed part way through and that were repeated.
    quantile_abs_dlogp_before: float | None = None  # The QUANTILE of |dlogp| over the tokens, worst engine.
    quantile_abs_dlogp_after: float | None = None
    quantile_abs_dlogp_after_per_dp_rank: list[float] | None = None
    gate_tolerances: dict | None = None  # As applied: mean, quantile, max, and whether the noise set them.
    change_test: dict | None = None  # After a step, whether vLLM followed the trainer's change; see ChangeTest.
    exact_check: dict | None = None  # ExactCheck: whether every engine holds, bit for bit, what was sent.
    exact_check_not_run: str | None = None  # Why this round had no exact check, such as "--tensor-parallel-size 2".
    # Per rank, once vLLM slept and before a training step: what the step could use (memory.free_for_step_gib).
    free_for_step_gib_per_rank: list[dict] | None = None
    # With --train only:
    reward_mean: float | None = None
    loss: float | None = None
    step_skipped: str | None = None  # Why no step was taken.
    unchanged_by_step: list[str] | None = None  # Trainer parameters the step left as they were.

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


def exact_line(exact: dict | None, not_run: str | None = None) -> str:
    """Return the exact check's line: what it compared bit for bit, what it did not and why, or why it did not run."""
    if exact is None:
        return f"[exact] not run: {not_run}" if not_run else "[exact] not run"
    if not exact["passed"]:
        return f"[exact] FAIL: {exact['problem']}"
    engines = f"{exact['dp_engines']} DP engine" + ("s" if exact["dp_engines"] != 1 else "")
    split = (
        f": trainers {exact['trainer_seconds']:.2f} s, engine 0 {exact['engine_seconds']:.2f} s"
        if exact.get("engine_seconds") is not None
        else ""
    )
    if exact.get("wait_seconds") is not None:
        split = f" beside the gate{split}; the round waited {exact['wait_seconds']:.3f} s for it"
    held = exact.get("parameters_held")
    of = f" of {held}" if held is not None else ""
    line = f"[exact] {exact['parameters_per_engine']}{of} vLLM parameters bit for bit on each of {engines}"
    if exact.get("derived"):
        views = exact.get("derived_views") or 0
        how = [f"{exact['derived'] - views} bit for bit as vLLM derives them again"] if exact["derived"] > views else []
        how += [f"{views} views into parameters compared above"] if views else []
        line += f", and {exact['derived']} derived by vLLM after loading ({'; '.join(how)})"
    if skipped := {k: n for k, n in (exact.get("not_compared") or {}).items() if n}:
        why = ", ".join(f"{n} {NOT_COMPARED.get(k, k)}" for k, n in skipped.items())
        line += f"; {sum(skipped.values())} not compared ({why})"
    casts: dict[str, int] = {}
    for cast in exact.get("held_in_other_dtype") or []:
        kind = cast.rpartition(": ")[2]
        casts[kind] = casts.get(kind, 0) + 1
    line += "".join(f"; {n} held in another dtype ({kind})" for kind, n in casts.items())
    return f"{line} ({exact['seconds']:.2f} s{split})"


def print_round(record: RoundRecord, tolerances: Tolerances) -> None:
    if record.exact_check is not None or record.exact_check_not_run:
        print(exact_line(record.exact_check, record.exact_check_not_run), flush=True)
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
        worst = c["residual_mean_per_dp_rank"].index(max(c["residual_mean_per_dp_rank"]))
        extra += (
            f", step's change {c['trainer_change_mean']:.4f} mean (noise {c['noise_mean']:.4f}): vLLM "
            f"{c['verdict']}"
            + (
                f" (residual {max(c['residual_mean_per_dp_rank']):.4f}, DP engine {worst})"
                if c["gated"]
                else ", not gated"
            )
        )
    if record.send_retries:
        extra += f", after {record.send_retries} retried send(s)"
    if record.unchanged_by_step:
        extra += f", {len(record.unchanged_by_step)} parameters unchanged by the step"
    tol = record.gate_tolerances or {"mean": tolerances.mean, "quantile": tolerances.quantile, "from_noise": False}
    basis = " from the trainer's kernel noise" if tol["from_noise"] else ""
    if tol.get("beyond_ceiling"):
        basis = ", its ceiling" + ("" if tol["gated"] else ": not gated, the exact check decides")
    print(
        f"[gate] |dlogp| mean {record.mean_abs_dlogp_before:.4f} before -> "
        f"{record.mean_abs_dlogp_after:.4f} after, worst engine (tolerance {tol['mean']:.4g}{basis}), "
        f"p{QUANTILE * 100:.0f} {record.quantile_abs_dlogp_before:.4f} -> {record.quantile_abs_dlogp_after:.4f} "
        f"(tolerance {tol['quantile']:.4g}), max {record.max_abs_dlogp_after:.4f}, {changed}{extra}: "
        f"{'pass' if record.gate_passed else 'FAIL'}",
        flush=True,
    )


def show_layout(placements: list[dict], num_nodes: int) -> None:
    """Print which node and GPUs each node's trainer ranks have.

    Ranks go in node order, with the same number on each node.
    """
    per_node = len(placements) // num_nodes
    for k in range(num_nodes):
        ranks = placements[k * per_node : (k + 1) * per_node]
        print(
            f"[trainers] node {k} ({ranks[0]['node_ip']}, Ray node {ranks[0]['node'][:8]}): ranks "
            f"{ranks[0]['rank']}-{ranks[-1]['rank']} on GPUs {[p['gpu_ids'][0] for p in ranks]} "
            f"({ranks[0].get('gpu_name', 'no GPU')})",
            flush=True,
        )


def memory_growth_gib(rounds: list[RoundRecord]) -> float:
    """Return the largest growth on any GPU, from round 2 to the last, of the memory this job uses after a sync.

    Where NVML cannot tell this job's processes apart, all processes count. Round 1 is left out because it
    allocates what every later round reuses: optimizer state, the IPC buffer and NCCL buffers.
    """
    if len(rounds) < 3:
        return 0.0
    first, last = rounds[1].memory_gib_per_rank, rounds[-1].memory_gib_per_rank

    def used(m: dict) -> float:  # Prefer this job's processes, because other jobs may share the GPU.
        return m["job_used"] if math.isfinite(m.get("job_used", math.nan)) else m["device_used"]

    return max(used(b) - used(a) for a, b in zip(first, last, strict=True))


def least_free_for_step_gib(rounds: list[dict]) -> float | None:
    """Return the least memory a training step could use, over the rounds' JSON and their GPUs; None if unmeasured.

    The least, because a step must fit on every GPU in every round."""
    totals = [m["total"] for r in rounds for m in r.get("free_for_step_gib_per_rank") or []]
    return min(totals) if totals else None


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


def run_result(
    args,
    job,
    rounds: list[RoundRecord],
    coverage: dict | None,
    time_to_first_sync_s: float,
    kernel_noise: KernelNoise | None = None,
) -> dict:
    """Build the run's JSON: how it was run, then what it measured; `kernel_noise` is the gate's basis."""
    return {
        **run_facts(args, job),
        "train": args.train,
        "kernel_noise": asdict(kernel_noise) if kernel_noise else None,
        "gate_ceiling": {"mean": MEAN_CEILING, "quantile": QUANTILE_CEILING},  # The most the noise widens to.
        "time_to_first_sync_s": time_to_first_sync_s,
        "coverage": coverage,
        "rounds": [r.to_json() for r in rounds],
        "memory_gib_per_rank": rounds[-1].memory_gib_per_rank,
        "memory_growth_gib": memory_growth_gib(rounds),
        "free_for_step_gib": least_free_for_step_gib([r.to_json() for r in rounds]),
        "retried_rounds": [i for i, r in enumerate(rounds, 1) if r.send_retries],
    }


def report(args, result: dict) -> int:
    """Print the summary, write the JSON for --json, and name every failed check; return 1 if any failed."""
    print(format_summary(result))
    if args.json:
        write_json(args.json, result)
        print(f"[json] {args.json}")
    failures = failed_checks(result, args.memory_growth_tolerance_gib)
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


def run_facts(args, job) -> dict:
    """Return what a reader needs to reproduce a result: hardware, versions, command and settings."""
    import vllm

    return {
        "gpu_name": job.gpu_name,
        "num_gpus": args.num_gpus,
        "num_nodes": args.num_nodes,
        "rank_nodes": job.rank_nodes,  # Each trainer rank's Ray node id.
        "tensor_parallel_size": args.tensor_parallel_size,
        "data_parallel_size": job.dp_size,
        "model": args.model,
        "architecture": job.architecture,
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%d"),
        "weight_loader": args.weight_loader,
        "weight_loader_reason": getattr(args, "weight_loader_reason", None),  # The default, or why not.
        "rollout_dtype": args.rollout_dtype,  # The dtype vLLM serves the routed experts in.
        "packed": args.packed,
        "packed_buffer_size_bytes": args.packed_buffer_size_bytes,
        "sleep_level": args.sleep_level,
        "free_kv_cache": args.free_kv_cache,  # As given; None means "with --train".
        "server_start_s": job.server.healthy_after_s,  # From its process's start, which imports vLLM first.
        # When that process was given its flags: it imported vLLM meanwhile, while the trainers started.
        "server_flags_given_s": getattr(job.server, "serving_after_s", None),
        "weights_in_after_s": job.weights_in_after_s,  # Seconds into the server's start, which it overlaps.
        "checkpoint_bytes_read_per_rank": job.checkpoint_bytes_read_per_rank,
        # With the direct loader: whether the engines copied the experts from the trainers' memory.
        "experts_in_place": job.experts_in_place,
        # With the direct loader: how many tensors the engines copied from the trainers' memory, none packed.
        "tensors_in_place": getattr(job, "tensors_in_place", None),
        # How vLLM's own loader reloads. vLLM 0.34 and later read VLLM_RELOAD_MODE from the server's
        # environment, where "direct" reloads in place; earlier versions always reload layer by layer.
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
    """Write strict JSON, with NaN, a number that could not be measured, written as null."""
    Path(path).write_text(json.dumps(_nan_to_null(result), indent=2, allow_nan=False) + "\n")


def _exact_cell(r: dict) -> str:
    """Return a round's exact check for the table: "pass 21/29" (bit for bit of held), "FAIL" or "not run"."""
    exact = r.get("exact_check")
    if not exact:
        return "not run" if r.get("exact_check_not_run") else "-"
    if not exact["passed"]:
        return "FAIL"
    held = exact.get("parameters_held")
    return f"pass {exact['parameters_per_engine']}/{held}" if held is not None else "pass"


def format_summary(result: dict) -> str:
    """Format a run's JSON result as a plain-text table."""
    train, nodes = result.get("train", False), result.get("num_nodes", 1)
    gpus = f"{result['num_gpus']} x {result['gpu_name']}" + (f" on {nodes} nodes" if nodes > 1 else "")
    lines = [
        f"model {result['model']} ({result['architecture']}) | {gpus} | "
        f"vLLM {result['vllm_version']} | server start {result['server_start_s']:.1f} s",
        "",
        "round | "
        + " | ".join(f"{p:>12}" for p in SYNC_PHASES)
        + " |    cycle | GB per GPU |   GB/s | mean|dlogp| before -> after | max after | changed | gate |         exact"
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
            f"{'pass' if r['gate_passed'] else 'FAIL'} | {_exact_cell(r):>13}"
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
    if (free := least_free_for_step_gib(result["rounds"])) is not None:
        lines.append(f"memory a training step could use once vLLM slept: {free:.2f} GiB (the least GPU, round)")
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
