"""Issue #5's failure cases that run without a GPU: the real CPU vLLM server
refuses or dies in the middle of a send, while the other trainer rank waits
in a collective (as ranks do between chunks). The driver must hear of it at
once, say what happened, and leave nothing running."""

import sys
import threading
import time

import pytest
import ray.cloudpickle
import torch.distributed as dist
from conftest import start_cpu_server

import helpers
import models
import rlhf_ipc_fsdp_ep as script

# Ray's workers cannot import this test module: ship its classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

CHUNK = {"ipc_handles": {}, "names": [], "dtype_names": [], "shapes": [], "tensor_sizes": []}


class FailingSendTrainer(script.FSDPTrainer):
    """send_weights as far as the failure goes: rank 0 talks to the real
    server (how depends on `mode`), rank 1 waits for it in a barrier."""

    def setup_weight_transfer(self, sock, mode, *_):
        self.sock, self.mode = sock, mode

    def send_weights(self):
        if self.rank == 0:
            if self.mode == "refused":
                # A chunk without direct_load_start: the real server refuses it.
                helpers.DirectLoadClient(self.sock, ["GPU-x"], {}).update_weights(CHUNK)
            while self.mode == "killed":  # keep talking to the server until it dies
                helpers.collective_rpc(self.sock, "direct_load_layout")
        dist.barrier()


def send_and_expect_failure(start_trainers, sock, mode, during=None):
    trainers = start_trainers(trainer_cls=FailingSendTrainer)
    script.ray_get_all([t.setup_weight_transfer.remote(sock, mode) for t in trainers])
    if during:
        threading.Timer(2.0, during).start()
    begin = time.monotonic()
    with pytest.raises(helpers.ServerError) as error:
        script.send_all(trainers)
    return str(error.value), time.monotonic() - begin


def test_a_refused_chunk_stops_the_send_at_once(fresh_cpu_trainers, cpu_server):
    message, seconds = send_and_expect_failure(fresh_cpu_trainers, cpu_server.socket_path, "refused")
    assert seconds < 30  # not the 10-minute collective timeout rank 1 is waiting in
    assert message.startswith("the send failed part way; vLLM holds a mix of old and new weights")
    assert "direct_load_start was not called" in message  # the server's own words


def test_a_server_killed_mid_send_stops_the_send_at_once(fresh_cpu_trainers, tmp_path):
    model = models.build_preset("tiny", tmp_path / "tiny")
    server = start_cpu_server(model, tmp_path, "--load-format", "dummy")
    try:
        message, seconds = send_and_expect_failure(
            fresh_cpu_trainers, server.socket_path, "killed", during=lambda: helpers.stop_server(server, grace_s=0)
        )
    finally:
        helpers.stop_server(server)
    assert seconds < 60
    assert "the send failed part way" in message and "/collective_rpc failed" in message
    assert helpers.group_members(server.pgid) == [] and not helpers.health(server.socket_path)
