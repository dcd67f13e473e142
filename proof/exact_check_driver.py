# SPDX-License-Identifier: Apache-2.0
"""Drive the exact check: every DP engine must hold, bit for bit, what the trainer rank on its GPU sent.

`prepare_exact_check` tells the engines what will be sent, once per setup. After each sync,
`start_exact_check` runs both halves in a thread beside the gate: rank_measurement.FingerprintedSource on the
trainers and exact_check_engine.ExactCheckWorker on the engines. `exact_check` takes the verdict.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
import time
from dataclasses import dataclass

import ray

import helpers
from proof.exact_accounting import expert_holders
from proof.rank_measurement import _measurement_call, measured, rank_fingerprints
from weight_sync import ray_trainers


def prepare_exact_check(job) -> dict:
    """Tell every engine what the trainers' current weight source sends.

    Each engine learns which of its parameters each tensor is written into; see
    ExactCheckWorker.exact_check_prepare in exact_check_engine.py. Call it after setting up a loader's transfer
    and before a full sync, because it leaves zeros where it probes.
    """
    sent = measured(job.trainers[:1], "sent_metadata")[0]
    # With one engine it must hold every tensor; with more, each expert where the trainer's own layout puts it.
    holders = expert_holders([n for n, *_ in sent], measured(job.trainers, "own_experts")) if job.dp_size > 1 else {}
    view = {"trainer_gpu_uuids": list(job.gpu_uuids), "holders": holders}
    # /collective_rpc returns the first DP engine's answer; another engine's problems fail its own checks.
    answers = helpers.collective_rpc(job.server.socket_path, "exact_check_prepare", json.dumps(sent), json.dumps(view))
    answer = answers[0]
    # Tensors vLLM holds in another dtype are fingerprinted after the same cast; JSON made the indices strings.
    # The trainer fingerprints each piece of a stacked parameter at the rows where it lands.
    rows = {int(index): row for index, row in answer.get("rows", {}).items()}
    rows = rows_on_every_engine(rows, [name for name, *_ in sent], job.dp_size)
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
    if answer.get("unaccounted"):
        print(
            f"[exact] DP engine 0 cannot account for {len(answer['unaccounted'])} sent tensors, so every exact "
            f"check fails: {answer['unaccounted'][:4]}",
            flush=True,
        )
    return answer


# One expert's tensor as vLLM's own loader takes it: `<layer>.experts.<id>.<name>`.
_ONE_EXPERT = re.compile(r"^(.*\.experts\.)(\d+)(\..+)$")


def rows_on_every_engine(rows: dict[int, int], names: list[str], dp_size: int) -> dict[int, int]:
    """Extend `rows`, the first DP engine's, with the rows of expert tensors held by DP engines other than the first.

    /collective_rpc returns only the first engine's prepare answer, which places only its own experts. With
    E experts in a layer and D DP engines, vLLM's linear expert placement gives engine k experts
    [k*E/D, (k+1)*E/D) in its slots in order. So expert e's tensor lands where expert e mod E/D's does on the
    first engine.
    """
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
    """Hold whether every DP engine holds exactly what the trainer rank on its GPU sent, per vLLM parameter.

    The engines' side is ExactCheckWorker.exact_check in exact_check_engine.py.
    """

    passed: bool
    # Start to verdict, run beside the gate: both sides' fingerprints and the comparison.
    seconds: float
    # Parameters compared bit for bit, element by element in place, per engine, as DP engine 0 counts them.
    parameters_per_engine: int | None
    dp_engines: int
    problem: str | None = None  # The first engine's message naming the parameters that differ.
    trainer_seconds: float | None = None  # Part of `seconds`: both sides started and the trainers' sums read back.
    engine_seconds: float | None = None  # DP engine 0's time inside its exact_check call; None if it failed.
    wait_seconds: float | None = None  # Time the round waited for the verdict after the gate.
    parameters_held: int | None = None  # Every parameter DP engine 0 holds, compared or not.
    # {exact_accounting.NOT_COMPARED key: count} of those not compared bit for bit, and their names.
    not_compared: dict[str, int] | None = None
    not_compared_parameters: dict[str, list[str]] | None = None
    # Parameters vLLM derives after loading from others, such as MLA's W_UK_T and W_UV: how many, and their names.
    # Each is a view into a parameter compared bit for bit (derived_views: how many, and {derived: that one}),
    # or else compared bit for bit with what vLLM derives again from what the engine holds.
    derived: int | None = None
    derived_parameters: list[str] | None = None
    derived_views: int | None = None
    derived_view_of: dict[str, str] | None = None
    # Sent tensors held in another dtype by a cast that keeps every bit or that the example asks for.
    held_in_other_dtype: list[str] | None = None


# Each of the check's four calls, to the trainer ranks or to the engines, gives up after this. The engines'
# calls are bounded by the server's own timeout, and HTTP waits 10 s longer for its reply.
CALL_TIMEOUT_S = helpers.SERVER_CALL_TIMEOUT_S

# Started checks without a verdict yet, each with the time.monotonic() by which it has surely ended.
_running_checks: dict[concurrent.futures.Future, float] = {}


class CheckTimedOut(RuntimeError):
    """A trainer rank or the engines did not answer one of the exact check's calls in time."""


def start_exact_check(job, call_timeout_s: float = CALL_TIMEOUT_S) -> concurrent.futures.Future:
    """Start the exact check after a sync, in its own thread beside the gate's requests.

    Every trainer rank and every DP engine start fingerprinting on their own CUDA streams, then each engine
    compares what it holds with what its trainer rank sent. Each call gives up after `call_timeout_s`, so the
    check ends by a deadline; exact_check(started) waits for the verdict until then.
    """
    verdict: concurrent.futures.Future = concurrent.futures.Future()
    _running_checks[verdict] = time.monotonic() + 4 * (call_timeout_s + 10) + 5

    def check() -> None:
        try:
            verdict.set_result(_exact_check(job, call_timeout_s))
        except BaseException as e:  # exact_check re-raises it in the round.
            verdict.set_exception(e)
        finally:
            helpers.forget_client(job.server.socket_path)  # This thread's connection to the server.
            _running_checks.pop(verdict, None)

    threading.Thread(target=check, name="exact-check", daemon=True).start()
    return verdict


def settle_exact_checks() -> None:
    """Wait for exact checks left running by a round that failed or was interrupted, each until its deadline.

    They call the trainers and the server, so they must finish before the job leaves Ray: a Ray call after
    ray.shutdown() would start a new local Ray.
    """
    for started, deadline in list(_running_checks.items()):
        if concurrent.futures.wait([started], timeout=max(0.0, deadline - time.monotonic())).not_done:
            print("[exact] a round's exact check is still running past its deadline; leaving it", flush=True)


def exact_check(started: concurrent.futures.Future) -> ExactCheck:
    """Wait for the verdict of the check start_exact_check started, recording the wait in `wait_seconds`."""
    waited = time.perf_counter()
    try:  # Every call in the check is bounded, so it ends by its deadline.
        result = started.result(timeout=max(0.0, _running_checks.get(started, 0.0) - time.monotonic()))
    except concurrent.futures.TimeoutError:
        raise CheckTimedOut("the exact check did not end by its deadline") from None
    result.wait_seconds = time.perf_counter() - waited
    return result


def _trainers_answer(trainers: list, method: str, timeout_s: float, *args) -> list:
    """Call RankMeasurement.<method>(*args) on every rank, as `measured` does, within `timeout_s`.

    Raise the first rank's failure as it comes, naming the rank, or CheckTimedOut naming the ranks still busy.
    """
    refs = [t.__ray_call__.remote(_measurement_call, method, *args) for t in trainers]
    pending, deadline = list(refs), time.monotonic() + timeout_s
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not done:
            late = ", ".join(str(refs.index(ref)) for ref in pending)
            raise CheckTimedOut(f"trainer rank {late} did not answer {method} within {timeout_s:.0f} s")
        ray_trainers.ray_get_all(done, who=f"trainer rank {refs.index(done[0])}")
    return ray.get(refs)


def _engines_answer(job, method: str, timeout_s: float, *args) -> list:
    """Call `method` on every engine with collective_rpc; raise CheckTimedOut if the server does not answer."""
    try:
        return helpers.collective_rpc(job.server.socket_path, method, *args, timeout=timeout_s)
    except helpers.ServerError as e:
        if "Timeout" not in str(e) and "timed out" not in str(e).lower():
            raise
        raise CheckTimedOut(
            f"the DP engines (0-{job.dp_size - 1}) did not answer {method} within {timeout_s:.0f} s: {e}"
        ) from e


def _exact_check(job, call_timeout_s: float = CALL_TIMEOUT_S) -> ExactCheck:
    """Run _both_halves; a call not answered within `call_timeout_s` fails the check, naming who did not answer."""
    start = time.perf_counter()
    try:
        return _both_halves(job, call_timeout_s)
    except CheckTimedOut as e:
        return ExactCheck(False, time.perf_counter() - start, None, job.dp_size, str(e)[:2000])


def _both_halves(job, call_timeout_s: float) -> ExactCheck:
    """Run both halves: each trainer rank fingerprints what it sent, and each DP engine compares on its GPU.

    Where a sent tensor is one model tensor, the trainer fingerprints it from its own model's shards. Each
    engine compares per parameter.
    """
    start = time.perf_counter()
    _trainers_answer(job.trainers, "start_sent_fingerprints", call_timeout_s)
    _engines_answer(job, "exact_check_start", call_timeout_s)
    sums = rank_fingerprints(_trainers_answer(job.trainers, "sent_fingerprints", call_timeout_s))
    trainer_seconds = time.perf_counter() - start
    expected = json.dumps(dict(zip(job.gpu_uuids, sums, strict=True)))
    try:
        answer = _engines_answer(job, "exact_check", call_timeout_s, expected)[0]
    except helpers.ServerError as e:  # Extract the engine's own message from the HTTP error's JSON.
        text = str(e)
        if (at := text.find("exact check: ")) >= 0:
            text = text[at + len("exact check: ") :].split('"', 1)[0]
        return ExactCheck(False, time.perf_counter() - start, None, job.dp_size, text[:2000], trainer_seconds)
    not_compared = answer.get("not_compared", {})
    return ExactCheck(
        True,
        time.perf_counter() - start,
        answer["bit_for_bit"],
        job.dp_size,
        None,
        trainer_seconds,
        answer.get("seconds"),
        parameters_held=answer["held"],
        not_compared={k: len(v) for k, v in not_compared.items()},
        not_compared_parameters=not_compared,
        derived=len(answer.get("derived", [])),
        derived_parameters=answer.get("derived", []),
        derived_views=len(answer.get("derived_views", {})),
        derived_view_of=answer.get("derived_views", {}),
        held_in_other_dtype=answer["casts"],
    )
