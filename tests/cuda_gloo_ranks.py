# SPDX-License-Identifier: Apache-2.0
"""Trainer ranks whose default process group has no backend for CPU tensors, on a machine without a GPU: the
sync's own collectives must still run (tests/test_weight_source.py runs it under torchrun, 2 ranks).

    torchrun --nproc-per-node 2 cuda_gloo_ranks.py

A default group made with init_process_group("cuda:gloo") runs collectives on CUDA tensors only, and here there
are none: as a user's NCCL-only group cannot take the CPU tensors of a host-side collective. Each line printed by
rank 0 is one of the sync's calls that runs a collective."""

import os
import sys
import time

import torch.distributed as dist

import helpers


class NoEngine:
    """vLLM's IPC trainer engine without tensors: rank 0 calls the client once, as it does per chunk; rank 1
    takes `slow_s` longer than rank 0 to be through (and then records when it was)."""

    def __init__(self, client, slow_s: float = 0.0) -> None:
        self.client, self.slow_s, self.through_at = client, slow_s, 0.0

    def send_weights(self) -> None:
        if dist.get_rank() == 0:
            self.client.update_weights({})
        else:
            time.sleep(self.slow_s)
        self.through_at = time.time()


class RefusingClient:
    refusing = True

    def update_weights(self, update_info: dict) -> None:
        if self.refusing:
            raise helpers.ServerError("refused by the stand-in server")


def main() -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from weight_sync import models, sources

    dist.init_process_group("cuda:gloo")
    say = print if dist.get_rank() == 0 else (lambda *_: None)
    say("default group:", dist.get_backend_config(), "| sync group:", dist.get_backend_config(helpers.sync_group()))
    say("every rank:", helpers.every_rank(dist.get_rank()))
    say("rank GPUs:", helpers.rank_gpus())
    say("on rank zero:", helpers.on_rank_zero(lambda: f"called on rank {dist.get_rank()}"))
    try:
        helpers.on_rank_zero(helpers.health, "/nowhere/vllm.sock") or helpers.on_rank_zero(helpers.sleep, "/x", 0)
    except helpers.ServerError as e:
        print(f"rank {dist.get_rank()} raised: {str(e)[:60]}", flush=True)
    config = AutoConfig.from_pretrained(models.build_preset("tiny", f"/tmp/cuda-gloo-tiny-{dist.get_rank()}"))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    source = sources.weight_source(model, dist.get_world_size(), "direct")
    say("direct source:", len(source.metadata), "tensors,", len(source.expert_blocks), "expert blocks")
    client = helpers.FailAfterSend(RefusingClient())
    sender = helpers.WeightSender(client, NoEngine(client), None, source, dist.get_rank(), True, 0, retries=1)
    try:
        sender.send()
    except helpers.ServerError as e:
        print(f"rank {dist.get_rank()} send raised: {str(e)[:80]}", flush=True)
    # A send that goes through, rank 1 through a second after rank 0: no rank returns before every rank is
    # through, so what each does at the end of its send (emptying PyTorch's cache) precedes the next call.
    client.client.refusing, engine = False, NoEngine(client, slow_s=1.0)
    sender = helpers.WeightSender(client, engine, None, source, dist.get_rank(), True, 0, retries=1)
    retries, returned_at = sender.send(empty_cache=True), time.time()
    through = helpers.every_rank(engine.through_at)
    say(
        "a send that went through: retried",
        retries,
        "| rank 0 returned after every rank was through:",
        returned_at >= max(through),
    )
    # Every rank through its last collective, then out without tearing the groups down: torch's teardown of a
    # "cuda:gloo" group on a machine without CUDA aborts now and then ("terminate called without an active
    # exception"), after everything here has run.
    dist.barrier(group=helpers.sync_group())
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
