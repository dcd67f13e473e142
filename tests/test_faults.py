# SPDX-License-Identifier: Apache-2.0
"""The failure cases that run without a GPU: the real CPU vLLM server
refuses or dies in the middle of a send, while the other trainer rank waits
in a collective (as ranks do between chunks). The driver must hear of it at
once, say what happened, and leave nothing running. (Also, on the
dummy-weight server whose engine a test here kills: vLLM's weight checker.)"""

import contextlib
import io
import os
import signal
import sys
import time

import pytest
import ray.cloudpickle
import torch.distributed as dist

import helpers
import rlhf_ipc_fsdp_ep as script
from conftest import start_cpu_server
from proof import coverage, program
from weight_sync import models, ray_trainers, sources

# Ray's workers cannot import this test module: ship its classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

# A chunk of one tensor of no bytes, in a buffer on another GPU: the real server refuses it, naming the GPUs.
CHUNK = {
    "ipc_handles": {"GPU-x": ()},
    "names": ["x"],
    "dtype_names": ["bfloat16"],
    "shapes": [[0]],
    "tensor_sizes": [0],
}
# A chunk of nothing: the direct loader takes it (it starts the sync on the engine, then adds nothing).
NOTHING = {"ipc_handles": {}, "names": [], "dtype_names": [], "shapes": [], "tensor_sizes": []}


class PackedSendShape:
    """What vLLM's IPC trainer engine does in a packed send, less the tensors
    (ipc_engine.py `send_weights` / `_send_packed`): only rank 0 calls the
    client; every rank meets the others after each chunk and after the
    finish. The first `refusing_sends` sends post chunks the real server
    refuses (no IPC buffer for its engine's GPU). With `until_failed`, rank 0
    sends chunks of nothing, which the server takes, until one fails."""

    def __init__(self, client, rank, refusing_sends, until_failed=False):
        self.client, self.rank, self.refusing_sends, self.sends = client, rank, refusing_sends, 0
        self.until_failed = until_failed

    def send_weights(self):
        self.sends += 1
        if self.rank == 0:
            self.client.start_weight_update()
        for _chunk in range(3):
            if self.rank == 0 and self.sends <= self.refusing_sends:
                self.client.update_weights(CHUNK)
            dist.barrier()
        going = [True]
        while self.until_failed and going[0]:
            if self.rank == 0:
                self.client.update_weights(NOTHING)
                going = [self.client._failure is None]
            dist.broadcast_object_list(going, src=0)  # as the engine's ranks meet after each chunk
        if self.rank == 0:
            self.client.finish_weight_update()
        dist.barrier()


class FlakySendTrainer(script.FSDPTrainer):
    """FSDPTrainer's own send_weights (helpers.WeightSender, with the client
    weight_sender builds: FailAfterSend around the direct loader's client, on
    the real server), and an engine that sends as vLLM's does
    (PackedSendShape)."""

    def setup_weight_transfer(self, sock, refusing_sends, retries, until_failed=False):
        client = helpers.FailAfterSend(sources.DirectLoadClient(sock, ["GPU-x"], {}))
        self.sender = helpers.WeightSender(
            client,
            PackedSendShape(client, self.rank, refusing_sends, until_failed),
            None,
            source=None,
            rank=self.rank,
            packed=True,
            packed_buffer_size_bytes=0,
            retries=retries,
        )

    def send_count(self):
        return self.sender.engine.sends


def flaky_trainers(start_trainers, sock, refusing_sends, retries, until_failed=False):
    trainers = start_trainers(trainer_cls=FlakySendTrainer)
    script.ray_get_all([t.setup_weight_transfer.remote(sock, refusing_sends, retries, until_failed) for t in trainers])
    return trainers


def test_a_refused_chunk_stops_the_send_at_once(fresh_cpu_trainers, cpu_server):
    trainers = flaky_trainers(fresh_cpu_trainers, cpu_server.socket_path, refusing_sends=99, retries=0)
    begin = time.monotonic()
    with pytest.raises(helpers.ServerError) as error:
        script.send_all(trainers)
    assert time.monotonic() - begin < 120  # not the 10-minute collective timeout rank 1 is waiting in
    message = str(error.value)
    assert message.startswith("a trainer rank: the send failed part way (not retried); vLLM holds a mix of old")
    assert "every engine needs a trainer rank on its own GPU" in message  # the server's own words
    assert script.ray_get_all([t.send_count.remote() for t in trainers]) == [1, 1]  # nobody was left in a barrier


@pytest.fixture(scope="module")
def dummy_server(tmp_path_factory):
    """One server with dummy weights, and what its start printed, for the two
    tests below: the first reads its weights, the second kills its engine."""
    folder = tmp_path_factory.mktemp("dummy")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        server = start_cpu_server(models.build_preset("tiny", folder / "tiny"), folder, "--load-format", "dummy")
    yield server, printed.getvalue()
    helpers.stop_server(server, grace_s=2)


def test_weight_checker_on_a_dummy_weight_server(dummy_server):
    """/weight_checker (used by --check-coverage) and the direct loader's fingerprints."""
    server, printed = dummy_server
    # While it started, its progress was printed from its log: each milestone once, in order.
    progress = [line.split(": ", 1)[1] for line in printed.splitlines() if line.startswith("[server]")]
    labels = [label for _, label in helpers.START_MILESTONES]
    assert {"engines starting", "engines ready", "API server listening"} <= set(progress), progress
    assert progress == sorted(set(progress), key=labels.index), progress
    dummy = coverage.weight_checker(server.socket_path, "checksum")["checksums"]
    assert dummy and all(key.startswith("dp0:") for key in dummy)
    assert coverage.weight_checker(server.socket_path, "compare", baseline=dummy) == {"match": True, "mismatches": []}
    # The direct loader's fingerprints (how the benchmark proves it equals vLLM's loader).
    (stored,) = helpers.collective_rpc(server.socket_path, "direct_load_fingerprint", "store")
    assert stored == {"dp_rank": 0, "parameters": 21}
    (same,) = helpers.collective_rpc(server.socket_path, "direct_load_fingerprint", "compare")
    assert same["differ"] == []
    coverage.weight_checker(server.socket_path, "reset")
    with pytest.raises(helpers.ServerError, match=r"DP rank 0: \d+ of 21 parameters differ.*embed_tokens"):
        helpers.collective_rpc(server.socket_path, "direct_load_fingerprint", "compare")
    zeros = coverage.weight_checker(server.socket_path, "checksum")["checksums"]
    assert set(zeros) == set(dummy)
    changed = set(coverage.weight_checker(server.socket_path, "compare", baseline=dummy)["mismatches"])
    # Seen on CPU: reset leaves the attention and router linears' checksums as
    # they were (CPU-specific weight handling), so only these are asserted here;
    # --check-coverage itself needs a GPU.
    for name in (
        "model.embed_tokens.weight",
        "model.layers.0.mlp.experts.routed_experts.w13_weight",
        "lm_head.weight",
    ):
        assert f"dp0:pp0:pcp0:tp0:{name}" in changed, sorted(changed)

    assert len(helpers.group_members(server.pgid)) >= 2  # API server + engine core at least


def test_an_engine_killed_mid_send_stops_the_send_at_once(fresh_cpu_trainers, dummy_server):
    """The engine core dies while a call is in flight: vLLM's API server stays
    up, waiting for that request, which never returns (until the 300 s call
    timeout). Rank 0's WeightSender sees the server stop answering /health and
    cuts its calls short; the send ends within seconds on every rank, named,
    and is not sent again to a server that does not answer."""
    server, _ = dummy_server

    def kill_the_engine_core():
        for pid in helpers.group_members(server.pgid):
            if b"EngineCore" in program.cmdline(pid):
                os.kill(pid, signal.SIGKILL)

    trainers = flaky_trainers(fresh_cpu_trainers, server.socket_path, refusing_sends=0, retries=1, until_failed=True)
    sending = [t.send_weights.remote() for t in trainers]
    time.sleep(3)
    assert not ray.wait(sending, timeout=0)[0]  # still sending chunks of nothing, which the server takes
    begin = time.monotonic()
    try:
        kill_the_engine_core()
        with pytest.raises(helpers.ServerError) as error:
            script.ray_get_all(sending)
    finally:
        helpers.stop_server(server, grace_s=2)  # (its API server would wait for the request in flight)
    assert time.monotonic() - begin < 60  # never the 300 s call timeout, nor the 10-minute collective timeout
    message = str(error.value)
    assert message.startswith("a trainer rank: the send failed part way (not retried: the server does not answer)")
    assert helpers.group_members(server.pgid) == [] and not helpers.health(server.socket_path)


def test_a_send_that_fails_once_is_sent_again(fresh_cpu_trainers, cpu_server):
    trainers = flaky_trainers(fresh_cpu_trainers, cpu_server.socket_path, refusing_sends=1, retries=1)
    _, retries = script.send_all(trainers)
    assert retries == 1
    assert script.ray_get_all([t.send_count.remote() for t in trainers]) == [2, 2]  # nobody was left in a barrier
    assert script.send_all(trainers)[1] == 0  # the server takes the next send


def test_a_send_that_keeps_failing_ends_after_the_retries(fresh_cpu_trainers, cpu_server):
    trainers = flaky_trainers(fresh_cpu_trainers, cpu_server.socket_path, refusing_sends=99, retries=2)
    begin = time.monotonic()
    with pytest.raises(helpers.ServerError) as error:
        script.send_all(trainers)
    assert time.monotonic() - begin < 150  # not the 10-minute collective timeout
    assert str(error.value).startswith("a trainer rank: the send failed part way (3 tries); vLLM holds a mix of old")
    assert "every engine needs a trainer rank on its own GPU" in str(error.value)
    assert script.ray_get_all([t.send_count.remote() for t in trainers]) == [3, 3]


def test_only_the_direct_loaders_sends_are_retried(ray_cluster):
    args = script.parse_args(["--send-retries", "2"])
    job = script.Job(
        trainers=[],
        server=helpers.Server(proc=None, socket_path="", log_path=None),
        served_name="",
        dp_size=1,
        architecture="",
        gpu_name="",
        gpu_uuids=[],
    )
    script.setup_weight_transfer_on_every_rank(job, args, "direct")
    assert job.send_retries == 2
    script.setup_weight_transfer_on_every_rank(
        job, args, "vllm"
    )  # vLLM's own route cannot take a second send after a failed chunk
    assert job.send_retries == 0


def _never_healthy_server(tmp_path, code: str) -> helpers.Server:
    """A real process in the server's place that never answers /health
    (`code` runs instead of vLLM)."""
    from conftest import private_socket_path

    return helpers.start_server(
        ["m"],
        socket_path=private_socket_path(),
        log_path=tmp_path / "server.log",
        launcher=(sys.executable, "-c", code),
    )


def test_a_rank_that_cannot_fill_its_weights_ends_the_start_at_once(fresh_cpu_trainers, tiny_checkpoint, tmp_path):
    """While the server starts, the trainers fill their weights: a rank that
    fails (here: the checkpoint cannot be read) ends the wait with its error,
    not after the server's start."""
    trainers = fresh_cpu_trainers()
    script.ray_get_all([t.build_model.remote(str(tiny_checkpoint)) for t in trainers])
    filling = [t.init_weights.remote(str(tmp_path / "missing"), False) for t in trainers]
    server = _never_healthy_server(tmp_path, "import time; time.sleep(300)")
    begin = time.monotonic()
    try:
        with pytest.raises(ray.exceptions.RayTaskError, match="missing has no safetensors files on this node"):
            ray_trainers.wait_until_ready(server, filling, timeout_s=240)
    finally:
        helpers.stop_server(server)
    assert time.monotonic() - begin < 120  # not the 240 s timeout


def _sleep(seconds):
    time.sleep(seconds)


def test_a_server_that_dies_while_the_trainers_fill_ends_the_start_at_once(ray_cluster, tmp_path):
    """...and a server that exits meanwhile ends it too, quoting its log,
    without waiting for the trainers."""
    slow_fill = ray.remote(_sleep).remote(120)
    server = _never_healthy_server(tmp_path, "import sys; print('no GPU here'); sys.exit(3)")
    begin = time.monotonic()
    with pytest.raises(helpers.ServerError, match=r"exited with code 3 during start(.|\n)*no GPU here"):
        ray_trainers.wait_until_ready(server, [slow_fill], timeout_s=240)
    assert time.monotonic() - begin < 90  # not the fill's 120 s
    helpers.stop_server(server)
    ray.cancel(slow_fill, force=True)
