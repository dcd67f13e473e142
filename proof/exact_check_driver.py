# SPDX-License-Identifier: Apache-2.0
"""The exact check, from the driver: every DP engine holds, bit for bit, what the trainer rank on its
GPU sent. `prepare_exact_check` once per setup tells the engines what will be sent; after each sync
`start_exact_check` runs both halves (rank_measurement.FingerprintedSource on the trainers,
exact_check_engine.ExactCheckWorker on the engines) in a thread beside the gate, and `exact_check`
takes the verdict."""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
import time
from dataclasses import dataclass

import helpers
from proof.rank_measurement import measured, rank_fingerprints


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
