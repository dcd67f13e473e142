# SPDX-License-Identifier: Apache-2.0
"""A user's own RL code under torchrun, without Ray, beside the copy table's first two rows.

    torchrun --nproc-per-node N torchrun_rl.py MODEL_DIR [LAUNCHER_JSON]

Every rank runs this file, one rank per GPU. The default process group is the user's own: NCCL alone on a GPU
(no backend for CPU tensors), gloo on CPU. Each rank loads the model from MODEL_DIR and shards it with FSDP2.
Rank 0 starts the vLLM server on every rank's GPU, on the same checkpoint: real weights, not dummy ones. Then,
through the direct loader and through vLLM's own loader, two rounds each of a training step and a sync, as the
README's torchrun round has them. After each sync it checks that vLLM holds the trainer's weights: every
parameter vLLM holds equals, bit for bit, what vLLM's own loader makes of the trainer's weights saved with
save_pretrained.

On CPU (tests/test_copy.py runs it with 2 gloo processes and a dense model) vLLM has neither sleep mode nor CUDA
IPC, and weight_sender needs a GPU. So the rounds skip the sleep and the wake, and what each rank's source
yields travels through a file to vLLM's loader instead. The direct loader's set-up still runs: the sources and
their process-group calls, and on the server the check and the learning its client's first call starts.
"""

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

import helpers
from weight_sync import sources

ON_GPU = torch.cuda.is_available()
SERVED_NAME = "mine"
SLEEP_LEVEL = {"direct": 0, "vllm": 2}  # 0: vLLM's weights stay on the GPU; 2: discarded, the sync rewrites them
RETRIES = {"direct": 1, "vllm": 0}  # vLLM's own loader leaves a failed send half done: not sent again


def shard(model_dir: str) -> torch.nn.Module:
    """The user's own model: loaded whole, then sharded with FSDP2 over every rank."""
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    model.to("cuda" if ON_GPU else "cpu")
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """A stand-in for the user's RL step: one AdamW step on the log-likelihood of a fixed sequence."""
    ids = torch.arange(1, 17, device="cuda" if ON_GPU else "cpu")[None]
    loss = -torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None]).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def checksums(sock: str) -> dict:
    """vLLM's digest of every parameter the server holds (its own names, after its loader)."""
    return helpers.request(sock, "POST", "/weight_checker", body={"action": "checksum"})["checksums"]


def reload_from(sock: str, folder: str) -> None:
    """vLLM's own loader reads the safetensors files in `folder` into the served model."""
    for method, kwargs in [
        ("update_config", {"overrides": {"load_config": {"load_format": "safetensors"}}}),
        ("reload_weights", {"weights_path": folder}),
    ]:
        helpers.request(sock, "POST", "/collective_rpc", body={"method": method, "kwargs": kwargs})


def saved(model: torch.nn.Module, folder: str) -> str:
    """The trainer's weights as save_pretrained writes them, gathered from every rank (every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        shutil.rmtree(folder, ignore_errors=True)
        model.save_pretrained(folder, state_dict=state)
    return folder


def sent_through_a_file(source, folder: str) -> str:
    """CPU stand-in for CUDA IPC: every tensor the source yields (every rank gathers with the others), written by
    rank 0 as one safetensors file, for vLLM's loader to read as its IPC engine would hand them over."""
    from safetensors.torch import save_file

    tensors = {name: t.detach().to("cpu", copy=True) for name, t in source.tensors()}  # valid until the next
    if dist.get_rank() == 0:
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
        save_file(tensors, os.path.join(folder, "model.safetensors"))
    return folder


def processes_on(sock: str) -> list[int]:
    """Live processes whose command line names the server's socket: the server's and its watchdog's."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if sock.encode() in argv and helpers.start_time(pid) is not None:
            found.append(int(pid))
    return found


def main(model_dir: str, launcher: tuple[str, ...] = helpers.DEFAULT_LAUNCHER) -> None:
    dist.init_process_group("nccl" if ON_GPU else "gloo")  # the user's own group: on a GPU, NCCL alone
    if ON_GPU:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = shard(model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scratch = tempfile.mkdtemp(prefix=f"torchrun-rl-{rank}-")
    gpus = helpers.rank_gpus()  # every rank's GPU: its id for --device-ids, and its UUID
    gpu_ids = [g["gpu_id"] for g in gpus] if ON_GPU else ["0"]  # (on CPU the launcher drops --device-ids)
    # On CPU no rank has a GPU: the server's one engine ("" off CUDA) pairs with rank 0.
    trainer_gpu_uuids = [g["gpu_uuid"] for g in gpus] if ON_GPU else ["", *(f"cpu-{r}" for r in range(1, world_size))]
    config = json.loads(Path(model_dir, "config.json").read_text())
    flags = helpers.serve_args(
        SERVED_NAME,
        gpu_ids,
        experts=any(key in config for key in ("num_experts", "num_local_experts", "n_routed_experts")),
        dummy_weights=False,  # the server holds the checkpoint's weights from its start, as a user's does
        worker_extension="weight_sync.direct_load.DirectLoadWorker",
        enforce_eager=True,
        max_model_len=512,
        kv_cache_tokens=1024,
    )
    if rank == 0:
        print("process group:", dist.get_backend_config(), "| ranks:", world_size, "| GPUs:", json.dumps(gpus))
        print("serve flags:", json.dumps(flags), flush=True)
    try:
        with helpers.vllm_server([model_dir, *flags], log_path="server.log", launcher=tuple(launcher)) as sock:
            for loader in ("direct", "vllm"):
                level = SLEEP_LEVEL[loader]
                source = sources.weight_source(model, world_size, loader)
                client = sources.sync_client(sock, loader, source, trainer_gpu_uuids)
                if ON_GPU:
                    sender = helpers.weight_sender(rank, client, source, retries=RETRIES[loader])
                else:  # what weight_sender asks of the client first: the direct loader checks and learns
                    client.init_weight_transfer_engine({"packed": True})
                if rank == 0 and getattr(client, "learned", None) is not None:
                    print(f"{loader}: the direct loader learned", json.dumps(client.learned, sort_keys=True))
                before = helpers.on_rank_zero(checksums, sock)
                for step in (1, 2):
                    if ON_GPU:  # the README's torchrun round
                        freed = helpers.on_rank_zero(helpers.sleep_for_sync, sock, level, free_kv_cache=True)
                        train_step(model, optimizer)
                        helpers.on_rank_zero(helpers.wake_weights, sock, level)
                        retried = sender.send(empty_cache=freed)
                        helpers.on_rank_zero(helpers.wake_to_serve, sock, kv_cache=freed)
                    else:
                        train_step(model, optimizer)
                        helpers.on_rank_zero(reload_from, sock, sent_through_a_file(source, f"{scratch}/sent"))
                        retried = 0
                    synced = helpers.on_rank_zero(checksums, sock)
                    helpers.on_rank_zero(reload_from, sock, saved(model, f"{scratch}/saved"))  # the reference
                    reference = helpers.on_rank_zero(checksums, sock)
                    changed = sum(synced[k] != before[k] for k in reference)
                    if rank == 0:
                        print(
                            f"{loader}: round {step}: vLLM holds the trainer's weights: {synced == reference} "
                            f"({changed} of {len(reference)} parameters changed by the step; retried {retried})",
                            flush=True,
                        )
                    before = reference
            if rank == 0:
                client = helpers.openai_client(sock)  # the server's OpenAI API, over its socket
                completion = client.completions.create(
                    model=SERVED_NAME, prompt="The capital of France is", max_tokens=8
                )
                print("serves after the rounds:", completion.usage.completion_tokens, "tokens", flush=True)
        if rank == 0:
            print("left: processes", processes_on(sock), "| its folder:", os.path.exists(os.path.dirname(sock)))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], *(tuple(json.loads(a)) for a in sys.argv[2:3]))
