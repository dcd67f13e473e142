# SPDX-License-Identifier: Apache-2.0
"""The fallback to vLLM's own loader, whole: with any one of vllm_adapter's INTERNALS missing, or of another
signature where it lists the parameters it must take, here and on the server's engines or on the engines only,
the default run syncs through vLLM's loader, and has its exact check or says in each round's line and JSON
that it has none and why; it ends with exit 0, never with a server error.

What runs on CPU: rlhf_ipc_fsdp_ep.py's main() with its flags as a user gives them, against a real vLLM server
(one for the module) whose engines lack the name (tests/lacking_worker.py takes it away in the engine's process
and puts it back after the case): the loader's choice before any GPU work, and again with the engines' own
vLLM; the proof's hooks, the exact check's choice among them; each round's calls to the server (completions,
sleep, wake); the round's verdict, its lines, the JSON and the exit code. What a CPU cannot run stands in, as
in test_cli_and_report's test of main(): the trainer ranks (no GPUs to place them on), the send (CUDA IPC),
and the exact check's two halves, with a passing verdict, where the run has one (test_families runs them on
real vLLM models, and test_vllm_adapter with each of these names missing)."""

import dataclasses
import json
from contextlib import contextmanager
from pathlib import Path

import pytest
from lacking_worker import needed, take_away

import helpers
import rlhf_ipc_fsdp_ep as script
from conftest import kv_cache_flags, start_cpu_server
from proof import exact_check_driver, logprob_gate, memory, rounds
from weight_sync.vllm_adapter import DIRECT_LOADER, EXACT_CHECK, INTERNALS


@pytest.fixture(scope="module")
def lacking_server(tiny_checkpoint, tmp_path_factory):
    """A CPU server of the tiny model whose engines can be made to lack a name (lacking_worker.LackingWorker)."""
    server = start_cpu_server(
        tiny_checkpoint,
        tmp_path_factory.mktemp("lacking"),
        *kv_cache_flags(1024),
        worker="lacking_worker.LackingWorker",
    )
    yield server
    helpers.stop_server(server)


# What vLLM's own code looks up as it serves: taken away on an engine, it would stop vLLM itself, not this
# project's code, so it is taken away here only.
VLLM_SERVES_WITH = {("vllm.platforms", "current_platform")}


# One case per entry, taken away here and on the engines; and one on the engines only for each entry a use
# needs (one read with a default changes no choice wherever it is missing).
CASES = [pytest.param(entry, True, id=f"{entry.name}-here-too") for entry in INTERNALS] + [
    pytest.param(entry, False, id=f"{entry.name}-on-the-engines-only") for entry in INTERNALS if entry.needed_by
]


def _gap(mean: float, logprob: float) -> logprob_gate.LogprobGap:
    return logprob_gate.LogprobGap([mean], [3 * mean], [[[logprob]]])


@pytest.mark.parametrize(("entry", "here_too"), CASES)
def test_without_one_internal_the_default_run_ends_through_vllms_loader(
    entry, here_too, lacking_server, tiny_checkpoint, tmp_path, monkeypatch, capsys
):
    """main() with one name taken away: the loader and the exact check as that name's needed_by says, each
    said once, in the words of the vLLM that lacks it; exit 0, the gate passed, one send."""
    sock = lacking_server.socket_path
    calls = []

    @contextmanager
    def job_on_cpu(args, proof=None):  # colocated_job's hooks at its named points, around the module's server
        proof.before_gpu_work(tiny_checkpoint, [args.weight_loader])
        proof.trainers_placed([{"gpu_uuid": "", "node_ip": "ip", "node": "node", "rank": 0, "gpu_ids": ["0"]}])
        server = dataclasses.replace(lacking_server, healthy_after_s=0.0)  # as wait_until_ready leaves it
        job = script.Job([], server, args.model, 1, "Qwen3MoeForCausalLM", "cpu", [""])
        proof.job_started(job)
        try:
            yield job
        finally:
            proof.job_ending()

    def recorded(name, result=None):
        return lambda *a, **kw: calls.append(name) or result

    gaps = iter([_gap(1.0, -1.0), _gap(0.01, -1.5)])  # the gap before the sync (dummy weights), then after it
    monkeypatch.setattr(script, "colocated_job", job_on_cpu)
    monkeypatch.setattr(script, "ray_get_all", lambda refs: [])  # the ranks' setup of vLLM's IPC engine
    monkeypatch.setattr(script, "send_all", recorded("send", (None, 0)))
    monkeypatch.setattr(rounds, "server_pgids_per_rank", lambda *a: [lacking_server.pgid])
    monkeypatch.setattr(rounds, "measure", recorded("measure"))
    monkeypatch.setattr(rounds, "prepare_exact_check", recorded("prepare_exact_check"))
    monkeypatch.setattr(rounds, "kernel_noise", lambda *a, **kw: logprob_gate.KernelNoise(0.01, 0.02, "sdpa vs eager"))
    monkeypatch.setattr(rounds, "job_logprob_gap", lambda job, sequences: next(gaps))
    monkeypatch.setattr(rounds, "start_exact_check", recorded("start_exact_check", "started"))
    passed = exact_check_driver.ExactCheck(True, 0.1, 21, 1, parameters_held=21)
    monkeypatch.setattr(rounds, "exact_check", lambda started: passed)
    breakdown = {"sync_bytes": [{"model": 10**6, "per_gpu": 10**6}], "send_breakdown": [{"total": 0.1}]}
    monkeypatch.setattr(rounds, "measured", lambda trainers, method: breakdown[method])
    monkeypatch.setattr(rounds, "memory", lambda *a: [memory.GPUMemory(1.0, 2.0, 3.0, 4.0)])

    on_the_engines = (entry.module, entry.name) not in VLLM_SERVES_WITH
    (taken,) = helpers.collective_rpc(sock, "take_away", entry.module, entry.name) if on_the_engines else [None]
    put_back_here = take_away(entry.module, entry.name) if here_too else (lambda: None)
    out = Path(tmp_path / "run.json")
    try:
        code = script.main(
            ["--model", "tiny", "--num-gpus", "1", "--prompt", "Hello", "--max-tokens", "2", "--json", str(out)]
        )
    finally:
        put_back_here()
        assert helpers.collective_rpc(sock, "put_back") == [[taken] if on_the_engines else []]
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    (record,) = result["rounds"]
    assert code == 0 and taken in (f"{entry.module}.{entry.name}", None)

    where = "this vLLM" if here_too else "DP engine 0's vLLM"
    named = f"{entry.module}.{entry.name} "
    if needed(entry, DIRECT_LOADER):
        line = f"[sync] {DIRECT_LOADER} needs what {where} lacks: {named}"
        assert printed.count(line) == 1 and printed.count("[sync] the direct loader needs") == 1, printed
        assert result["weight_loader"] == "vllm", result["weight_loader_reason"]
        assert result["weight_loader_reason"].endswith("; syncing through vLLM's own loader instead")
    else:
        assert (result["weight_loader"], result["weight_loader_reason"]) == ("direct", "the default")
        assert "needs what" not in printed
    if needed(entry, EXACT_CHECK):
        not_run = f"{where} lacks what {EXACT_CHECK} needs: {named}"
        assert record["exact_check"] is None and record["exact_check_not_run"].startswith(not_run), record
        assert f"[exact] not run: {not_run}" in printed
        assert "prepare_exact_check" not in calls and "start_exact_check" not in calls
    else:
        assert record["exact_check"]["passed"] and record["exact_check_not_run"] is None
        assert calls.count("prepare_exact_check") == calls.count("start_exact_check") == 1
    assert calls.count("send") == 1 and record["gate_passed"]


def test_the_engines_say_what_their_vllm_lacks_for_each_use(lacking_server, monkeypatch):
    """The engines' own check as the driver makes it (sources.engines_lack): an engine that lacks nothing
    answers None; a lack, for the direct loader or for the exact check, comes back as (which engine's vLLM, what
    it lacks in one line), read from the error the engine raised, which is how any DP engine is heard, not the
    first alone. Any other error of the call is raised as it is."""
    from weight_sync import sources

    sock = lacking_server.socket_path
    assert sources.engines_lack(sock, DIRECT_LOADER) is None and sources.engines_lack(sock, EXACT_CHECK) is None
    helpers.collective_rpc(sock, "take_away", "vllm.config", "set_current_vllm_config")
    helpers.collective_rpc(sock, "take_away", "vllm.distributed.weight_transfer.packed_tensor", "unpack_tensor")
    try:
        where, line = sources.engines_lack(sock, DIRECT_LOADER)
        assert where == "DP engine 0's vLLM" and line.endswith(" (and 1 more)")
        assert line.startswith("vllm.distributed.weight_transfer.packed_tensor.unpack_tensor takes (other, arguments)")
        where, line = sources.engines_lack(sock, EXACT_CHECK)  # the exact check does not need unpack_tensor
        assert where == "DP engine 0's vLLM" and line.startswith("vllm.config.set_current_vllm_config is missing (")
    finally:
        assert len(helpers.collective_rpc(sock, "put_back")[0]) == 2
    assert sources.engines_lack(sock, DIRECT_LOADER) is None
    monkeypatch.setattr(sources, "collective_rpc", lambda *a: helpers.collective_rpc(sock, "no_such_method"))
    with pytest.raises(helpers.ServerError, match="no_such_method"):
        sources.engines_lack(sock, DIRECT_LOADER)
