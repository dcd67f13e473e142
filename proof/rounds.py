# SPDX-License-Identifier: Apache-2.0
"""Wrap the job with its proof and measurement, without touching the job's own steps.

`Proof` is the one object the script's main() and colocated_job call: hooks at named points of the job, then
before_rounds, round and report. `RoundProof` is called by one round at its named steps, and judges the round
once it is through by running the exact check beside the logprob gate in judged_round.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict

from proof import preflight
from proof.coverage import check_coverage
from proof.exact_check_driver import (
    ExactCheck,
    exact_check,
    prepare_exact_check,
    settle_exact_checks,
    start_exact_check,
)
from proof.logprob_gate import (
    MEAN_CEILING,
    QUANTILE,
    QUANTILE_CEILING,
    KernelNoise,
    LogprobGap,
    Tolerances,
    gate,
    job_logprob_gap,
    kernel_noise,
)
from proof.memory import free_for_step, memory, server_pgids_per_rank
from proof.rank_measurement import measure, measured
from proof.report import RoundRecord, print_round, report, round_record, run_result, show_layout
from weight_sync import generation
from weight_sync.sources import engines_lack
from weight_sync.vllm_adapter import EXACT_CHECK, exact_check_choice


class PhaseTimer:
    """Time named phases in wall-clock seconds: `with timer.phase("sleep"): ...`.

    `wall` keeps each phase's start and end by the machine's clock, which the trainer ranks on this machine share,
    so that ray_call_split can tell Ray's share of the send from the rank's."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.wall: dict[str, tuple[float, float]] = {}

    @contextmanager
    def phase(self, name: str):
        print(f"[{name}] ...", flush=True)
        start, wall_start = time.perf_counter(), time.time()
        try:
            yield
        finally:
            self.seconds[name] = time.perf_counter() - start
            self.wall[name] = (wall_start, time.time())
            print(f"[{name}] {self.seconds[name]:.2f} s", flush=True)


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
    send_wall: tuple[float, float] | None = None,
    free_at_step: list[dict] | None = None,
    exact_check_not_run: str | None = None,
) -> RoundRecord:
    """Build and print a round's record as the JSON stores it, with the checks' verdicts.

    The record holds `phases` as measured, each rank's send_breakdown, the logprob gaps before and after the
    sync, and the exact check. `noise` is the gap on identical weights, which is this round's `before` when the
    previous sync was proven exact. With --train, `training` is {"reward_mean", "loss"}, with loss None when no
    step was taken. `server_pgids` is as `memory` takes it, and `kernel_noise` is as measured before the first
    sync. `send_wall` is the send phase's start and end by the machine's clock; see ray_call_split.
    `free_at_step` is, per rank, what a training step could have used once vLLM slept (memory.free_for_step_gib).
    Without an exact check, `exact_check_not_run` says why. The round passes only if both the gate and the exact
    check pass; see failed_checks.
    """
    tolerances = Tolerances.from_args(args, kernel_noise)
    stepped = training is not None and training["loss"] is not None
    verdict = gate(
        before, after, tolerances, weights_updated, noise=noise, stepped=stepped, exact_check_runs=exact is not None
    )
    synced = measured(trainers[:1], "sync_bytes")[0]
    send_per_rank = ray_call_split(measured(trainers, "send_breakdown"), send_wall)
    record = round_record(
        phases, send_per_rank, synced, before, after, verdict, memory(trainers, server_pgids), weights_updated
    )
    record.send_retries = send_retries
    record.free_for_step_gib_per_rank = free_at_step
    widened = (verdict.mean_tolerance, verdict.quantile_tolerance) != (tolerances.mean, tolerances.quantile)
    record.gate_tolerances = {
        "mean": verdict.mean_tolerance,
        "quantile": verdict.quantile_tolerance,
        "max": tolerances.max,
        "from_noise": widened,
        "mean_ceiling": MEAN_CEILING,
        "quantile_ceiling": QUANTILE_CEILING,
        "beyond_ceiling": tolerances.beyond_ceiling(),  # The kernel noise asks for more: the gate cannot see a sync.
        "gated": verdict.tolerances_gated,  # Whether the mean and quantile gated; if not, the exact check did.
    }
    if exact is not None:
        record.exact_check = asdict(exact)
    else:
        record.exact_check_not_run = exact_check_not_run
    if training is not None:
        record.reward_mean, record.loss = training["reward_mean"], training["loss"]
        if training["loss"] is None:
            record.step_skipped = "every sample had the same reward: a step would change nothing"
        else:
            record.unchanged_by_step = measured(trainers[:1], "unchanged_by_last_step")[0]
    print_round(record, tolerances)
    return record


def exact_check_not_run(args, lacks: str | None = None) -> str | None:
    """Say why the rounds have no exact check, or return None if they have one.

    Under tensor parallelism each engine holds shards of the parameters, which the check does not compare.
    `lacks` is exact_check_choice's answer for the driver's vLLM or the engines': what the check needs and
    that vLLM lacks."""
    if args.tensor_parallel_size > 1:
        return f"--tensor-parallel-size {args.tensor_parallel_size}"
    return lacks


def ray_call_split(send_per_rank: list[dict], send_wall: tuple[float, float] | None) -> list[dict]:
    """Return the ranks' send breakdowns with rank 0's Ray call split out, and no clock readings left in them.

    Rank 0 runs on the driver's machine, so their clocks agree: `ray_call` is the time from the driver's call to
    the rank's send starting, and `ray_return` from its end to the driver having the answer. Another machine's
    clock may differ, so other ranks get neither."""
    for rank, seconds in enumerate(send_per_rank):
        started, ended = seconds.pop("started_at", None), seconds.pop("ended_at", None)
        if rank == 0 and send_wall is not None and started is not None:
            seconds["ray_call"], seconds["ray_return"] = started - send_wall[0], send_wall[1] - ended
    return send_per_rank


class RoundProof:
    """Prove and measure one round from outside it.

    The round calls `generated` with the batch both sides score, `step` around each phase and `trained`
    after the training step. Once the round is done, `verdict()` runs the exact check beside the gate and
    returns the round's record. `first_sync` means vLLM still holds its dummy weights. `previous` is [] or
    the previous round's record in a list. `kernel_noise` is the gate's basis, and `server_pgids` is as
    `memory` takes it. `exact_check_lacks` is what the check needs that vLLM lacks, if anything.
    """

    def __init__(
        self,
        job,
        args,
        first_sync: bool,
        previous: list[RoundRecord] = (),
        kernel_noise: KernelNoise | None = None,
        server_pgids: list | None = None,
        exact_check_lacks: str | None = None,
    ) -> None:
        self.job, self.args, self.first_sync = job, args, first_sync
        self.exact_check_not_run = exact_check_not_run(args, exact_check_lacks)
        self.kernel_noise, self.server_pgids = kernel_noise, server_pgids
        # If the previous sync passed the exact check, vLLM held the trainer's weights bit for bit.
        self.proven = any(r.exact_check and r.exact_check["passed"] for r in previous)
        self.timer = PhaseTimer()
        self.sequences: list[list[int]] = []
        self.before: LogprobGap | None = None
        self.training: dict | None = None
        self.send_retries = 0  # From send_all: sends the server failed part way through and that were repeated.
        self.free_at_step: list[dict] | None = None  # Per rank, once vLLM slept: see memory.free_for_step_gib.

    def generated(self, batch: list[generation.Completion]) -> None:
        """Record the tokens the trainer and every DP engine score, and measure their gap before the sync."""
        self.sequences = [c.prompt_token_ids + c.token_ids for c in batch]
        self.before = job_logprob_gap(self.job, self.sequences)

    @contextmanager
    def step(self, name: str):
        """Time a phase with PhaseTimer: `with proof.step("send"): ...`.

        After the sleep, outside its time and before a training step, measure what such a step could use."""
        with self.timer.phase(name):
            yield
        if name == "sleep":
            self.free_at_step = free_for_step(self.job.trainers)

    def trained(self, reward_mean: float, loss: float | None) -> None:
        """Record, with --train, the batch's mean reward and the step's loss, which is None if no step was taken."""
        self.training = {"reward_mean": reward_mean, "loss": loss}

    def verdict(self) -> RoundRecord:
        """Run the exact check and the gate, and return the round's record.

        The exact check runs in its own thread beside the gate. It is skipped with tensor parallelism,
        because each engine then holds shards, and where vLLM lacks what it needs. The gate checks that vLLM
        now scores the batch as the trainer does. If the previous sync was proven exact, vLLM held the
        trainer's weights bit for bit when `before` was measured, so `before` is the change test's reference. It never widens the gate's tolerance; only
        the trainer's own noise does.
        """
        job, args = self.job, self.args
        started = start_exact_check(job) if self.exact_check_not_run is None else None
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
            server_pgids=self.server_pgids,
            kernel_noise=self.kernel_noise,
            send_wall=self.timer.wall.get("send"),
            free_at_step=self.free_at_step,
            exact_check_not_run=self.exact_check_not_run,
        )


class Proof:
    """Prove and measure the script's job from outside its steps.

    colocated_job calls the hooks before_gpu_work, trainers_placed, job_started and job_ending, and
    setup_weight_transfer_on_every_rank calls transfer_ready. main() calls before_rounds to measure the gate's
    basis, round for each round's proof, judged when the round exits, and report. `started_at` is
    time.monotonic() at the program's start; time_to_first_sync_s counts from it.
    """

    def __init__(self, args, started_at: float | None = None) -> None:
        self.args = args
        self.started_at = time.monotonic() if started_at is None else started_at
        self.job = None
        self.server_pgids: list | None = None  # Per rank, the process group of its node's vLLM server.
        self.kernel_noise: KernelNoise | None = None  # The gate's basis, measured before the first sync.
        self.coverage: dict | None = None  # --check-coverage's result for the most recent transfer.
        self.rounds: list[RoundRecord] = []  # Records of the rounds run through the most recent transfer.
        self.time_to_first_sync_s: float | None = None
        # What the exact check needs and this interpreter's vLLM lacks; job_started asks the engines too.
        self.exact_check_lacks = exact_check_choice(args.rollout_dtype == "fp8")

    # colocated_job's hooks

    def before_gpu_work(self, model_path, loaders: list[str]) -> None:
        """Exit with one line if the model cannot be synced as asked; see preflight.before_gpu_work."""
        preflight.before_gpu_work(self.args, model_path, loaders)

    def trainers_placed(self, placements: list[dict]) -> None:
        """Print where Ray placed the trainer ranks; exit with one line if two share a GPU."""
        show_layout(placements, self.args.num_nodes)
        if problem := preflight.placement_problem(placements):
            raise SystemExit(f"error: {problem}")

    def job_started(self, job) -> None:
        """Record the job once the server is up and the trainers' weights are loaded.

        Also find the process group of each rank's node's server, to tell its GPU memory from other processes',
        and ask every engine whether its vLLM, which may differ from this interpreter's, lacks what the exact
        check needs: if one does, the rounds have no exact check, each saying why.
        """
        self.job = job
        self.server_pgids = server_pgids_per_rank(job.server, job.node_servers, self.args.num_gpus, self.args.num_nodes)
        if self.why_no_exact_check() is None:
            lacks = engines_lack(job.server.socket_path, EXACT_CHECK, self.args.rollout_dtype)
            if lacks is not None:
                where, line = lacks
                self.exact_check_lacks = exact_check_choice(missing=lambda *_, **__: [line], where=where)

    def why_no_exact_check(self) -> str | None:
        """Say why the rounds have no exact check, or return None if they have one."""
        return exact_check_not_run(self.args, self.exact_check_lacks)

    def job_ending(self) -> None:
        """Settle a round's exact check that is still running, before the job leaves Ray."""
        settle_exact_checks()

    # setup_weight_transfer_on_every_rank's hook

    def transfer_ready(self, job, args) -> None:
        """Start measuring once every rank's sender is built with `args`.

        From now on every send is timed and fingerprinted and every step is watched. Where the rounds have an
        exact check (see exact_check_not_run), the engines learn what will be sent for it, which leaves zeros
        where they probe. With --check-coverage, the coverage sync runs here. The rounds that follow belong to
        this transfer.
        """
        self.args, self.rounds = args, []
        measure(job.trainers)
        if self.why_no_exact_check() is None:
            prepare_exact_check(job)
        self.coverage = check_coverage(job, args.sleep_level) if args.check_coverage else None

    # main()'s calls

    def before_rounds(self, greedy: list[generation.Completion]) -> None:
        """Measure the gate's basis: the trainer's own kernel noise on these completions' tokens."""
        sequences = [c.prompt_token_ids + c.token_ids for c in greedy]
        self.kernel_noise = kernel_noise(self.job.trainers, sequences, fp8=self.args.rollout_dtype == "fp8")
        if Tolerances.from_args(self.args, self.kernel_noise).beyond_ceiling():
            not_run = self.why_no_exact_check()
            print(
                f"[gate] {self.args.noise_multiple:g} x the trainer's kernel noise is beyond the gate's ceiling "
                f"(mean {MEAN_CEILING}, p{QUANTILE * 100:.0f} {QUANTILE_CEILING}): the gate cannot see a sync on "
                "this model; "
                + (
                    "the exact check gives each round's verdict"
                    if not_run is None
                    else f"there is no exact check ({not_run}), so the gate holds at its ceiling"
                ),
                flush=True,
            )

    @contextmanager
    def round(self, i: int):
        """Yield the round's RoundProof: `with proof.round(i) as round_proof: ...`.

        When the round is through, step 7 runs the exact check and the gate, and the record goes into
        `rounds`. Round 1's sync replaces vLLM's dummy weights, unless the coverage check's sync already did.
        """
        round_proof = RoundProof(
            self.job,
            self.args,
            first_sync=i == 1 and self.coverage is None,
            previous=self.rounds[-1:],
            kernel_noise=self.kernel_noise,
            server_pgids=self.server_pgids,
            exact_check_lacks=self.exact_check_lacks,
        )
        yield round_proof
        self.rounds.append(round_proof.verdict())
        if self.time_to_first_sync_s is None:
            self.time_to_first_sync_s = time.monotonic() - self.started_at

    def report(self) -> int:
        """Print the table, write the JSON for --json, name every failed check, and return the exit code."""
        result = run_result(
            self.args, self.job, self.rounds, self.coverage, self.time_to_first_sync_s, self.kernel_noise
        )
        return report(self.args, result)
