# SPDX-License-Identifier: Apache-2.0
"""A user's own RL code with Ray, beside helpers.py and weight_sync/ray_trainers.py alone, with vLLM's own
loader and a dense model, as vLLM's own example has it. tests/test_copy.py copies them into an empty folder
and runs this there, with nothing else of this project importable; on a GPU machine it runs the same way.

It does what the README's Ray path shows for vLLM's loader: its own FSDP2 trainer class as 2 Ray ranks, a
vLLM server started with `serving([model, *serve_args(name, gpu_ids)])` (dummy weights, vLLM's default
worker, no extension of ours), and vLLM's ModuleSource over the trainer's model.

    python ray_trainer_rl.py MODEL_DIR [LAUNCHER_JSON]

On a GPU (one or more), the sync is the real one: sleep, every rank's send through vLLM's IPC trainer
engine, wake. On CPU vLLM has neither sleep mode nor CUDA IPC, so the tensors ModuleSource yields travel
through a file to the same loader (vLLM's reload_weights), and rank 0's client makes its real calls to
vLLM's weight routes with no chunk between them. Either way, afterwards every parameter vLLM holds must
equal, bit for bit, what vLLM's own loader makes of the checkpoint the trainers loaded.
"""

import atexit
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import ray
import torch
import torch.distributed as dist

import helpers
from weight_sync import ray_trainers

SERVED_NAME = "tiny"
ON_GPU = torch.cuda.is_available()


class MyTrainer:
    """Loaded from the checkpoint the server serves, sharded with FSDP2: the user's own."""

    sender = None

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoModelForCausalLM

        device = "cuda" if ON_GPU else "cpu"  # Ray shows each rank its own GPU as cuda:0
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device)

    def shard(self) -> None:  # once start_trainers has joined the ranks in one process group
        from torch.distributed.fsdp import fully_shard

        for layer in self.model.model.layers:
            fully_shard(layer)
        fully_shard(self.model)

    def source(self):
        from vllm.distributed.weight_transfer.base import ModuleSource

        return ModuleSource(self.model)

    def metadata(self) -> list:
        """(name, shape, dtype) of each tensor ModuleSource sends (vLLM 0.32: a method; later: a property)."""
        metas = self.source().metadata
        return [(m.name, list(m.shape), str(m.dtype)) for m in (metas() if callable(metas) else metas)]

    def setup_sender(self, sock: str) -> None:
        """vLLM's IPC trainer engine on this rank, as helpers.py's docstring builds it."""
        self.sender = helpers.weight_sender(dist.get_rank(), helpers.WeightSyncClient(sock), self.source())

    def send_weights(self, empty_cache: bool = False) -> int:  # what ray_trainers.send_all calls, on every rank at once
        return self.sender.send(empty_cache)

    def save_sent(self, folder: str) -> int:
        """Every tensor ModuleSource yields, full (each rank gathers its shards with the others), written
        by rank 0 as one safetensors file: what the IPC engine would hand the server's loader."""
        from safetensors.torch import save_file

        source = self.source()
        sent = dict(source.iter_full() if hasattr(source, "iter_full") else source)  # (vLLM 0.32: iterating it)
        if dist.get_rank() == 0:
            tensors = {name: t.detach().cpu().contiguous() for name, t in sent.items()}
            save_file(tensors, os.path.join(folder, "model.safetensors"))
        return len(sent)


def checksums(sock: str) -> dict:
    """vLLM's digest of every parameter the server holds (its own names, after its loader)."""
    return helpers.request(sock, "POST", "/weight_checker", body={"action": "checksum"})["checksums"]


def reload_from(sock: str, folder: str) -> None:
    """vLLM's own loader reads the safetensors files in `folder` into the served model (the server
    started with dummy weights: first its load format becomes safetensors)."""
    for method, kwargs in [
        ("update_config", {"overrides": {"load_config": {"load_format": "safetensors"}}}),
        ("reload_weights", {"weights_path": folder}),
    ]:
        helpers.request(sock, "POST", "/collective_rpc", body={"method": method, "kwargs": kwargs})


def greedy(sock: str, prompt: str) -> list[int]:
    """The server's greedy completion of `prompt`, 8 tokens, through the OpenAI client over its socket."""
    out = helpers.openai_client(sock).completions.create(
        model=SERVED_NAME, prompt=prompt, max_tokens=8, temperature=0.0, extra_body={"return_token_ids": True}
    )
    return list(out.choices[0].token_ids)


def watchdogs(socket_path: str) -> list[int]:
    """Live processes of this server's watchdog (its command line: the marker and the socket)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if helpers.WATCHDOG_MARKER.encode() in argv and socket_path.encode() in argv and helpers.start_time(pid):
            found.append(int(pid))
    return found


def sync(trainers: list, sock: str) -> None:
    """One sync as helpers.py's docstring has it: sleep, send on every rank, wake."""
    ray_trainers.ray_get_all([t.setup_sender.remote(sock) for t in trainers])
    freed = helpers.sleep_for_sync(sock, level=0, free_kv_cache=False)
    helpers.wake_weights(sock, level=0)
    ray_trainers.send_all(trainers)
    helpers.wake_to_serve(sock, kv_cache=freed)


def sync_on_cpu(trainers: list, sock: str) -> None:
    """The CPU stand-in for the data plane: rank 0's calls to vLLM's weight routes with no chunk between
    them (the engine's reload starts and finishes), then what ModuleSource yields, through a file, into
    the same loader the IPC engine's receive_weights calls (model.load_weights)."""
    client = helpers.FailAfterSend(helpers.WeightSyncClient(sock))
    client.init_weight_transfer_engine({"packed": True})
    client.start_weight_update()
    client.finish_weight_update()
    client.raise_failure()
    print("weight routes round trip:", True)
    folder = tempfile.mkdtemp(prefix="sent-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    counts = ray_trainers.ray_get_all([t.save_sent.remote(folder) for t in trainers])
    reload_from(sock, folder)
    print("sent", counts)


def main(model_dir: str, launcher: tuple[str, ...] = helpers.DEFAULT_LAUNCHER) -> None:
    from safetensors import safe_open

    socket_path = str(Path(tempfile.mkdtemp(prefix="alone-")) / "vllm.sock")
    atexit.register(shutil.rmtree, Path(socket_path).parent, ignore_errors=True)
    ray.init(
        address="local", num_cpus=2, num_gpus=torch.cuda.device_count(), include_dashboard=False, log_to_driver=False
    )
    try:
        # One rank per GPU (each engine reads the buffer of the rank on its GPU); 2 on CPU.
        ranks = torch.cuda.device_count() if ON_GPU else 2
        trainers, _ = ray_trainers.start_trainers(
            MyTrainer, ranks, gpus_per_trainer=1 if ON_GPU else 0, trainer_args=(model_dir,)
        )
        gpu_ids = [p["gpu_ids"][0] for p in ray_trainers.placements(trainers)] if ON_GPU else ["0"]
        flags = helpers.serve_args(
            SERVED_NAME, gpu_ids, experts=False, enforce_eager=True, max_model_len=512, kv_cache_tokens=1024
        )
        print("serve flags:", json.dumps(flags))
        with helpers.serving(
            [model_dir, *flags], socket_path=socket_path, log_path="server.log", launcher=tuple(launcher)
        ) as server:
            ray_trainers.ray_get_all([t.shard.remote() for t in trainers])
            metas = ray_trainers.ray_get_all([t.metadata.remote() for t in trainers])
            print("ranks", [p["rank"] for p in ray_trainers.placements(trainers)])
            print("same metadata on every rank:", all(m == metas[0] for m in metas))
            with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:  # what vLLM's loader reads
                loaded = sorted((name, list(f.get_slice(name).get_shape())) for name in f.keys())
            print(
                "ModuleSource's names and shapes are the checkpoint's:",
                sorted((name, shape) for name, shape, _ in metas[0]) == loaded,
                len(loaded),
            )
            helpers.wait_until_healthy(server, timeout_s=900)
            print("watchdogs while serving:", len(watchdogs(socket_path)))
            sock = server.socket_path
            dummy, prompt = checksums(sock), ["The capital of France is"]
            (sync if ON_GPU else sync_on_cpu)(trainers, sock)
            synced = checksums(sock)
            after_sync = greedy(sock, prompt[0])
            reload_from(sock, model_dir)  # the reference: vLLM's own loader reading the checkpoint itself
            reference = checksums(sock)
            print(
                "parameters:",
                len(reference),
                "changed from the dummy weights:",
                sum(synced[k] != dummy[k] for k in reference),
            )
            print("every parameter as vLLM loads the checkpoint:", synced == reference)
            after_reload = greedy(sock, prompt[0])
            print("same greedy completion:", after_sync == after_reload, len(after_sync))
        print("group left:", helpers.group_members(server.pgid))
        print("watchdogs left:", watchdogs(socket_path))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], *(tuple(json.loads(a)) for a in sys.argv[2:3]))
