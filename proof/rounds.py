# SPDX-License-Identifier: Apache-2.0
"""The proof around the job, from outside its steps: `Proof`, the one object the script's main() and
colocated_job call (hooks at named points of the job, then before_rounds, round and report), and
`RoundProof`, which one round calls at its named steps and which judges the round once it is through
(the exact check beside the gate: judged_round)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict

import helpers
from proof import preflight
from proof.coverage import check_coverage
from proof.exact_check_driver import (
    ExactCheck,
    exact_check,
    prepare_exact_check,
    settle_exact_checks,
    start_exact_check,
)
from proof.logprob_gate import KernelNoise, LogprobGap, Tolerances, gate, job_logprob_gap, kernel_noise
from proof.memory import memory, server_pgids_per_rank
from proof.rank_measurement import measure, measured
from proof.report import RoundRecord, print_round, report, round_record, run_result, show_layout


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
    `previous`: the previous round's record, if any ([] or [record]);
    `kernel_noise`: the gate's basis; `server_pgids`: as `memory` takes them."""

    def __init__(
        self,
        job,
        args,
        first_sync: bool,
        previous: list[RoundRecord] = (),
        kernel_noise: KernelNoise | None = None,
        server_pgids: list | None = None,
    ) -> None:
        self.job, self.args, self.first_sync = job, args, first_sync
        self.kernel_noise, self.server_pgids = kernel_noise, server_pgids
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
            server_pgids=self.server_pgids,
            kernel_noise=self.kernel_noise,
        )


class Proof:
    """The script's proof and measurement, around the job from outside its steps. colocated_job and
    setup_weight_transfer_on_every_rank call its hooks at named points (before_gpu_work,
    trainers_placed, job_started, job_ending; transfer_ready); main() calls three methods:
    before_rounds (the gate's basis), round (each round's proof, judged on the way out) and report.
    `started_at`: time.monotonic() at the program's start, which time_to_first_sync_s counts from."""

    def __init__(self, args, started_at: float | None = None) -> None:
        self.args = args
        self.started_at = time.monotonic() if started_at is None else started_at
        self.job = None
        self.server_pgids: list | None = None  # per rank, the process group of its node's vLLM server
        self.kernel_noise: KernelNoise | None = None  # the gate's basis, measured before the first sync
        self.coverage: dict | None = None  # --check-coverage's result, for the transfer set up last
        self.rounds: list[RoundRecord] = []  # the records of the rounds through the transfer set up last
        self.time_to_first_sync_s: float | None = None

    # colocated_job's hooks

    def before_gpu_work(self, model_path, loaders: list[str]) -> None:
        """Exit with one line if the model cannot be synced as asked (preflight.before_gpu_work)."""
        preflight.before_gpu_work(self.args, model_path, loaders)

    def trainers_placed(self, placements: list[dict]) -> None:
        """Print where Ray placed the trainer ranks; exit with one line if two share a GPU."""
        show_layout(placements, self.args.num_nodes)
        if problem := preflight.placement_problem(placements):
            raise SystemExit(f"error: {problem}")

    def job_started(self, job) -> None:
        """The server is up and the trainers' weights are in: the job to watch, and the process group
        of each rank's node's server (to tell its GPU memory from other processes')."""
        self.job = job
        self.server_pgids = server_pgids_per_rank(job.server, job.node_servers, self.args.num_gpus, self.args.num_nodes)

    def job_ending(self) -> None:
        """Before the job leaves Ray: a round's exact check, if the round ended before its verdict."""
        settle_exact_checks()

    # setup_weight_transfer_on_every_rank's hook

    def transfer_ready(self, job, args) -> None:
        """Every rank's sender is built, with `args`: from now on every send is timed and fingerprinted
        and every step watched; the engines learn what will be sent (the exact check; TP shards each
        parameter: not checked), which leaves zeros where they probe; with --check-coverage, the
        coverage sync. The rounds that follow are this transfer's."""
        self.args, self.rounds = args, []
        measure(job.trainers)
        if args.tensor_parallel_size == 1:
            prepare_exact_check(job)
        self.coverage = check_coverage(job, args.sleep_level) if args.check_coverage else None

    # main()'s

    def before_rounds(self, greedy: list[helpers.Completion]) -> None:
        """The gate's basis: the trainer's own kernel noise on these completions' tokens."""
        sequences = [c.prompt_token_ids + c.token_ids for c in greedy]
        self.kernel_noise = kernel_noise(self.job.trainers, sequences, fp8=self.args.rollout_dtype == "fp8")

    @contextmanager
    def round(self, i: int):
        """`with proof.round(i) as round_proof:` the round's RoundProof; once the round is through,
        step 7, the exact check and the gate (the record goes into `rounds`). Round 1's sync replaces
        vLLM's dummy weights, unless the coverage check's did."""
        round_proof = RoundProof(
            self.job,
            self.args,
            first_sync=i == 1 and self.coverage is None,
            previous=self.rounds[-1:],
            kernel_noise=self.kernel_noise,
            server_pgids=self.server_pgids,
        )
        yield round_proof
        self.rounds.append(round_proof.verdict())
        if self.time_to_first_sync_s is None:
            self.time_to_first_sync_s = time.monotonic() - self.started_at

    def report(self) -> int:
        """Print the table, write the JSON (--json), name every failed check; the exit code."""
        result = run_result(
            self.args, self.job, self.rounds, self.coverage, self.time_to_first_sync_s, self.kernel_noise
        )
        return report(self.args, result)
