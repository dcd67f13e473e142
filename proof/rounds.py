# SPDX-License-Identifier: Apache-2.0
"""One round's proof, from outside the round: `RoundProof`, which the round calls at its named
steps and which judges the round once it is through (the exact check beside the gate: judged_round)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict

import helpers
from proof.exact_check_driver import ExactCheck, exact_check, start_exact_check
from proof.logprob_gate import KernelNoise, LogprobGap, Tolerances, gate, job_logprob_gap
from proof.memory import memory
from proof.rank_measurement import measured
from proof.report import RoundRecord, print_round, round_record


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
