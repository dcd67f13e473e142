# SPDX-License-Identifier: Apache-2.0
"""Benchmark the weight sync of rlhf_ipc_fsdp_ep.py: every phase, both loaders, one job.

    python scripts/benchmark.py --model qwen3-30b-a3b-shape --num-gpus 2      # no download
    python scripts/benchmark.py --model tiny --num-gpus 2 --loaders direct

It starts the trainers and the server once, then for each loader in --loaders
(default: vllm, then direct), or each loader, sleep level and buffer size in
--variants:
  1. zeroes every vLLM parameter, so that round 1 has to bring the weights back
     (with --check-coverage: zeroes them, syncs, and lists those left zero);
  2. runs --rounds syncs (default 3), each checked by the script's logprob gate,
     recording the seconds of every phase, where the send's time went on each
     trainer rank, the memory of the trainer and the server on every GPU, what
     a training step could use once vLLM slept (the least of the rounds beside
     the variant's cycle: `free_for_step_gib`), and the round against its
     floor: the bytes each GPU receives, copied once at the rate this job's
     GPUs copy at (measured once, at the start, beside what the sync's calls
     to vLLM and to the ranks cost, each made alone).
With both loaders it then proves them equivalent: after a sync through vLLM's
loader it fingerprints every vLLM parameter on every DP engine, zeroes them
all, syncs through the direct loader, and requires every parameter to be back
bit for bit.

The JSON (default docs/benchmarks/<date>-<model>-<N>x<gpu>.json) is rewritten
after every step, so a run that is cut short keeps what it measured. Every other
flag is the script's (see `python rlhf_ipc_fsdp_ep.py --help`).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the script and its packages
import helpers  # noqa: E402
import rlhf_ipc_fsdp_ep as script  # noqa: E402
from proof import coverage, preflight, rank_measurement, report  # noqa: E402
from proof.rounds import Proof  # noqa: E402
from weight_sync import generation  # noqa: E402

LOADERS = ("vllm", "direct")


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    p.add_argument("-h", "--help", action="store_true")
    p.add_argument("--loaders", nargs="+", choices=LOADERS, help=f"loaders to compare (default: {' '.join(LOADERS)})")
    p.add_argument(
        "--variants",
        nargs="+",
        metavar="LOADER:LEVEL[:GIB]",
        type=_variant,
        help="loader, sleep "
        "level and (optionally) packed buffer size in GiB of each variant, in order, e.g. direct:0 "
        "direct:0:4 vllm:0 (default: --loaders at the script's --sleep-level and buffer size)",
    )
    p.add_argument("--out", help="JSON path (default docs/benchmarks/<date>-<model>-<N>x<gpu>.json)")
    p.add_argument(
        "--profile-round",
        type=int,
        default=0,
        metavar="K",
        help="profile the direct loader's round K (Python, cProfile) on every trainer rank and DP engine: "
        "the top functions by cumulative time, as text beside the JSON (<out>.direct-roundK.rankR.txt, "
        "...engineD.txt); the round's times then include the profiler's",
    )
    p.add_argument(
        "--throughput",
        metavar="PROMPTSxTOKENS",
        type=_throughput,
        help="after the syncs, vLLM's "
        "generation throughput: this many greedy completions of this many tokens each (EOS ignored), "
        "split over the DP engines, e.g. 64x256; the median of 3 batches after one to warm up",
    )
    bench, rest = p.parse_known_args(argv)
    if bench.help:
        p.print_help()
        print("\nAll other flags are rlhf_ipc_fsdp_ep.py's; --rounds defaults to 3 here.")
        sys.exit(0)
    args = script.parse_args(["--rounds", "3", *rest])  # a --rounds in `rest` comes later and wins
    if bench.variants and bench.loaders:
        p.error("pass --loaders or --variants, not both")
    bench.variants = bench.variants or [(loader, args.sleep_level, None) for loader in bench.loaders or LOADERS]
    bench.loaders = list(dict.fromkeys(loader for loader, *_ in bench.variants))
    for loader in bench.loaders:  # every loader's flags, before any GPU work
        if problem := preflight.loader_flag_problem(args, loader):
            p.error(problem)
    if problem := preflight.unwritable("--out", bench.out):
        p.error(problem)
    return bench, args


def _throughput(text: str) -> tuple[int, int]:
    prompts, _, tokens = text.partition("x")
    if not (prompts.isdigit() and tokens.isdigit() and int(prompts) > 0 and int(tokens) > 0):
        raise argparse.ArgumentTypeError(f"expected PROMPTSxTOKENS, e.g. 64x256, not {text!r}")
    return int(prompts), int(tokens)


def generation_throughput(job: script.Job, prompts: int, tokens: int, repeats: int = 3) -> dict:
    """vLLM's generation throughput in tokens per second: `prompts` greedy
    completions of `tokens` tokens each (EOS ignored), split evenly over the
    DP engines and sent to them at once; the median of `repeats` batches,
    after one that warms up."""
    from concurrent.futures import ThreadPoolExecutor

    texts = [f"{i}. {script.DEFAULT_PROMPTS[i % len(script.DEFAULT_PROMPTS)]}" for i in range(prompts)]
    shares = [texts[rank :: job.dp_size] for rank in range(job.dp_size)]

    def batch() -> tuple[float, int]:
        def one(rank: int) -> int:
            out = generation.post_completions(
                job.server.socket_path,
                rank,
                model=job.served_name,
                prompt=shares[rank],
                max_tokens=tokens,
                temperature=0.0,
                extra_body={"ignore_eos": True},
            )
            return out.usage.completion_tokens

        start = time.perf_counter()
        with ThreadPoolExecutor(job.dp_size) as pool:
            generated = sum(pool.map(one, [r for r in range(job.dp_size) if shares[r]]))
        return time.perf_counter() - start, generated

    batch()  # warm-up
    timed = [batch() for _ in range(repeats)]
    seconds = statistics.median(t for t, _ in timed)
    result = {
        "prompts": prompts,
        "tokens_per_prompt": tokens,
        "generated_tokens": timed[0][1],
        "seconds": [t for t, _ in timed],
        "tokens_per_s": timed[0][1] / seconds,
    }
    print(
        f"[throughput] {prompts} x {tokens} tokens: {result['tokens_per_s']:.0f} tokens/s "
        f"(median of {repeats}: {seconds:.2f} s)",
        flush=True,
    )
    return result


def control_plane_seconds(job: script.Job, repeats: int = 20) -> dict:
    """What a level-0 sync pays besides its copies, each part timed alone, in a sync's order: the median seconds
    of vLLM's pause (`sleep`), an empty Ray call into every trainer rank (`ray_call`), an empty call into every
    engine (`server_call`, vLLM's no-op check_health through /collective_rpc), and the resume (`wake`), each as
    the script makes it. A sync takes at least its copy floor plus their sum (`total`)."""
    sock, trainers = job.server.socket_path, job.trainers

    def empty_ray_call() -> None:  # waited on as send_all waits on the ranks, with a check every 2 s
        script.ray_get_all([t.__ray_call__.remote(_nothing) for t in trainers], also_check=lambda: None)

    calls = {
        "sleep": partial(helpers.sleep, sock, 0),
        "ray_call": empty_ray_call,
        "server_call": partial(helpers.collective_rpc, sock, "check_health"),
        "wake": partial(helpers.wake_up, sock, ["scheduling"]),
    }
    seconds = {part: [] for part in calls}
    for _ in range(repeats):
        for part, call in calls.items():
            start = time.perf_counter()
            call()
            seconds[part].append(time.perf_counter() - start)
    medians = {part: statistics.median(s) for part, s in seconds.items()}
    print(
        f"[floor] a sync's calls, each alone (median of {repeats}): "
        + ", ".join(f"{part} {s * 1e3:.1f} ms" for part, s in medians.items())
        + f"; {sum(medians.values()) * 1e3:.1f} ms in all",
        flush=True,
    )
    return {**medians, "total": sum(medians.values()), "repeats": repeats}


def _nothing(trainer) -> None:
    pass


def _variant(text: str) -> tuple[str, int, int | None]:
    """LOADER:LEVEL[:GIB] -> (loader, sleep level, packed buffer bytes or None: the script's)."""
    loader, level, *gib = text.split(":")
    gib_ok = not gib or len(gib) == 1 and gib[0].isdigit() and int(gib[0]) > 0
    if loader not in LOADERS or level not in ("0", "1", "2") or not gib_ok:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected LOADER:LEVEL[:GIB], LOADER one of {LOADERS}, LEVEL 0-2, GIB a whole number"
        )
    return loader, int(level), int(gib[0]) * 1024**3 if gib else None


def run_variant(
    job: script.Job,
    args: argparse.Namespace,
    proof: Proof,
    loader: str,
    sleep_level: int,
    buffer_bytes: int | None = None,
    started_at: float | None = None,
    device_copy_gb_per_s: float | None = None,
    profile: tuple[int, str] | None = None,
) -> dict:
    """--rounds syncs through `loader` at `sleep_level` (with a packed buffer
    of `buffer_bytes`, if given), starting from zeroed vLLM weights, each
    round judged by `proof` (the script's checks, from outside the round). With
    `started_at` (the benchmark's start), also the seconds from then to the
    end of this variant's first gated sync; with `device_copy_gb_per_s`, each
    round against its copy floor (with_floor). `profile`: (round, path prefix) to profile, direct loader only."""
    args = argparse.Namespace(
        **{
            **vars(args),
            "sleep_level": sleep_level,
            "packed_buffer_size_bytes": buffer_bytes or args.packed_buffer_size_bytes,
        }
    )
    # The proof tells the engines what will be sent before the weights are zeroed (it probes them,
    # and leaves them zero), and runs the coverage sync if asked (Proof.transfer_ready).
    script.setup_weight_transfer_on_every_rank(job, args, loader, proof)
    if proof.coverage is None:  # vLLM forgets the weights: round 1 must bring them back
        coverage.weight_checker(job.server.socket_path, "reset")
    for i in range(1, args.rounds + 1):
        print(
            f"=== {loader} loader, sleep level {sleep_level}, {args.packed_buffer_size_bytes / 1024**3:g} GiB "
            f"buffer, round {i}/{args.rounds} ===",
            flush=True,
        )
        if profile and profile[0] == i and loader == "direct":
            profile_next_sync(job, f"{profile[1]}.direct-round{i}")
        with proof.round(i) as round_proof:
            script.run_round(job, args, round_proof)
        print_send_breakdown(proof.rounds[-1].send_breakdown_s)
        print_floor(with_floor(proof.rounds[-1].to_json(), device_copy_gb_per_s))
        if i == 1 and started_at is not None:
            time_to_first_sync_s = time.monotonic() - started_at
    rounds = proof.rounds
    profiled = profile[0] if profile and loader == "direct" else None  # its times include the profiler's
    rounds_json = [
        {**with_floor(r.to_json(), device_copy_gb_per_s), "profiled": i == profiled} for i, r in enumerate(rounds, 1)
    ]
    return {
        "weight_loader": loader,
        "sleep_level": sleep_level,
        "packed_buffer_size_bytes": args.packed_buffer_size_bytes,
        "experts_in_place": job.experts_in_place if loader == "direct" else None,
        "tensors_in_place": job.tensors_in_place if loader == "direct" else None,
        "coverage": proof.coverage,
        "rounds": rounds_json,
        "median_cycle_s": statistics.median(r.cycle_s for i, r in enumerate(rounds, 1) if i != profiled),
        # Beside the sync's time, what it leaves a training step at this sleep level: the least over the rounds.
        "free_for_step_gib": report.least_free_for_step_gib(rounds_json),
        "median_send_s": statistics.median(r.phases_s["send"] for r in rounds),
        "memory_gib_per_rank": rounds[-1].memory_gib_per_rank,
        "memory_growth_gib": report.memory_growth_gib(rounds),
        **({"time_to_first_sync_s": time_to_first_sync_s} if started_at is not None else {}),
    }


def with_floor(round_json: dict, device_copy_gb_per_s: float | None) -> dict:
    """A round's JSON, with its floor if the device's copy rate is known: the
    bytes each GPU receives, copied once at that rate (copy_floor_s), and how
    many times that the cycle took (floor_ratio)."""
    if not device_copy_gb_per_s:
        return round_json
    floor = round_json["bytes_per_gpu"] / (device_copy_gb_per_s * 1e9)
    return {**round_json, "copy_floor_s": floor, "floor_ratio": round_json["cycle_s"] / floor if floor else math.nan}


def print_floor(round_json: dict) -> None:
    if "copy_floor_s" in round_json:
        print(
            f"[floor] {round_json['bytes_per_gpu'] / 1e9:.2f} GB per GPU, copied once: "
            f"{round_json['copy_floor_s'] * 1e3:.1f} ms; the cycle took {round_json['floor_ratio']:.1f} times that",
            flush=True,
        )


def print_send_breakdown(send_per_rank: list[dict]) -> None:
    for rank, s in enumerate(send_per_rank):
        server = sum(v for k, v in s.items() if k.startswith("server_") and not k.endswith("_calls"))
        calls = int(s.get("server_update_weights_calls", 0))
        print(
            f"[send] rank {rank}: {s['total']:.2f} s = source {s.get('source', 0):.2f} s"
            + (f" + server {server:.2f} s ({calls} chunks)" if rank == 0 else "")
            + f" + packing and handshakes {s['total'] - s.get('source', 0) - server:.2f} s",
            flush=True,
        )
        if "ray_call" in s:
            print(
                f"[send]   Ray's call into rank {rank}: {s['ray_call']:.4f} s, its return {s['ray_return']:.4f} s",
                flush=True,
            )
        if engine := {k.removeprefix("engine_"): v for k, v in s.items() if k.startswith("engine_")}:
            print(
                "[send]   of the server's, inside DP engine 0: "
                + ", ".join(f"{part} {seconds:.2f} s" for part, seconds in engine.items()),
                flush=True,
            )


def loaders_agree(job: script.Job, args: argparse.Namespace) -> dict:
    """Sync through vLLM's loader, fingerprint every vLLM parameter on every
    DP engine, zero them all, sync through the direct loader: every
    parameter must be back bit for bit (the call fails, naming them, if not)."""
    sock = job.server.socket_path
    print("=== do the loaders agree? ===", flush=True)
    script.setup_weight_transfer_on_every_rank(job, args, "vllm")
    helpers.sleep_for_sync(sock, args.sleep_level)
    helpers.wake_weights(sock, args.sleep_level)
    script.send_all(job.trainers, check_failure=partial(script.raise_node_failure, job.node_servers))
    helpers.wake_to_serve(sock)
    stored = helpers.collective_rpc(sock, "direct_load_fingerprint", "store")[0]
    script.setup_weight_transfer_on_every_rank(job, args, "direct")
    coverage.zero_vllm_weights(sock, args.sleep_level)
    script.send_all(job.trainers, check_failure=partial(script.raise_node_failure, job.node_servers))
    helpers.wake_to_serve(sock)
    try:
        compared = helpers.collective_rpc(sock, "direct_load_fingerprint", "compare")[0]
    except helpers.ServerError as e:
        print(f"[agree] NO: {e}", flush=True)
        return {"agree": False, "parameters_per_engine": stored["parameters"], "error": str(e)[:2000]}
    print(f"[agree] yes: {compared['parameters']} parameters per engine, bit for bit", flush=True)
    return {"agree": True, "parameters_per_engine": stored["parameters"]}


class _ProfiledOnce:
    """A trainer rank's sender whose next send runs under cProfile; then the rank's own sender is back."""

    def __init__(self, trainer, path: str) -> None:
        self._trainer, self._sender, self._path = trainer, trainer.sender, path

    def send(self, empty_cache: bool = False) -> int:
        import cProfile

        from proof.exact_check_engine import write_profile

        profiler = cProfile.Profile()
        profiler.enable()
        try:
            return self._sender.send(empty_cache)
        finally:
            profiler.disable()
            self._trainer.sender = self._sender
            write_profile(profiler, self._path)

    def __getattr__(self, name: str):
        return getattr(self._sender, name)


def _profile_next_send(trainer, path: str) -> None:
    import torch.distributed as dist

    trainer.sender = _ProfiledOnce(trainer, f"{path}.rank{dist.get_rank()}.txt")


def profile_next_sync(job: script.Job, path: str) -> None:
    """Profile the next send on every trainer rank and the next direct sync on every DP engine."""
    script.ray_get_all([t.__ray_call__.remote(_profile_next_send, path) for t in job.trainers])
    helpers.collective_rpc(job.server.socket_path, "profile_next_sync", path)


def default_out(result: dict) -> Path:
    gpu = result["gpu_name"].lower().replace("nvidia", "").strip().replace(" ", "-")
    return Path("docs/benchmarks") / f"{result['date']}-{result['model']}-{result['num_gpus']}x{gpu}.json"


def main(argv: list[str] | None = None) -> int:
    start = time.monotonic()
    bench, args = parse_args(argv)
    proof = Proof(args, start)
    with script.colocated_job(args, loaders=bench.loaders, proof=proof) as job:
        result = {**report.run_facts(args, job), "weight_loader": bench.loaders, "rounds_per_loader": args.rounds}
        greedy = generation.completions(job.server.socket_path, job.served_name, args.prompts, args.max_tokens)
        proof.before_rounds(greedy)  # the gate's basis: the trainer's own kernel noise
        result["kernel_noise"] = asdict(proof.kernel_noise) if proof.kernel_noise else None
        # The floor every round is measured against: this job's GPUs' own copy rate (the slowest one's).
        result["device_copy_gb_per_s"] = script.ray_get_all(
            [t.__ray_call__.remote(rank_measurement.device_copy_gb_per_s) for t in job.trainers]
        )
        print(
            f"[floor] device copy rate per GPU: {', '.join(f'{r:.0f}' for r in result['device_copy_gb_per_s'])} GB/s",
            flush=True,
        )
        result["control_plane_s"] = control_plane_seconds(job)
        result["variants"] = []
        out = Path(bench.out) if bench.out else default_out(result)
        out.parent.mkdir(parents=True, exist_ok=True)
        for loader, level, buffer_bytes in bench.variants:
            variant = run_variant(
                job,
                args,
                proof,
                loader,
                level,
                buffer_bytes,
                None if result["variants"] else start,
                min(result["device_copy_gb_per_s"]),
                (bench.profile_round, str(out.with_suffix(""))) if bench.profile_round else None,
            )
            result["variants"].append(variant)
            # Like the script's, but after zeroing vLLM's weights (and the coverage check, if asked).
            result.setdefault("time_to_first_sync_s", variant.get("time_to_first_sync_s"))
            if loader == "direct":  # (run_facts came before any setup)
                result["experts_in_place"] = variant["experts_in_place"]
                result["tensors_in_place"] = variant["tensors_in_place"]
            report.write_json(out, result)  # after every step: a run cut short keeps what it measured
            print(report.format_summary({**result, **variant}), flush=True)
        if set(bench.loaders) == set(LOADERS):
            result["loaders_agree"] = loaders_agree(job, args)
            report.write_json(out, result)
        if bench.throughput:
            result["generation"] = generation_throughput(job, *bench.throughput)
            report.write_json(out, result)
        print(f"[json] {out}")

    failures = [
        f"{v['weight_loader']} loader, sleep level {v['sleep_level']}, "
        f"{v['packed_buffer_size_bytes'] / 1024**3:g} GiB buffer, {failure}"
        for v in result["variants"]
        for failure in report.failed_checks(v, args.memory_growth_tolerance_gib)
    ]
    if result.get("loaders_agree", {}).get("agree") is False:
        failures.append("the direct loader did not reproduce vLLM's parameters")
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    print(f"[benchmark] {time.monotonic() - start:.0f} s in all")
    return 1 if failures else 0


if __name__ == "__main__":
    script.program.cli(main)
