"""A user's own RL code beside helpers.py alone, with vLLM's own loader and a
dense model, as vLLM's own example has it (tests/test_copy.py copies the two
into an empty folder and runs this there, with nothing else of this project
importable): its own FSDP2 trainer class as 2 Ray ranks on gloo, vLLM's
ModuleSource over it, and a real vLLM server with vLLM's default worker (no
extension of ours), started and stopped through helpers.

    python helpers_alone_rl.py MODEL_DIR SERVE_FLAGS_JSON LAUNCHER_JSON
"""

import json
import os
import sys
import tempfile
from pathlib import Path

import ray
import torch
import torch.distributed as dist

import helpers


class MyTrainer:
    """Loaded from the checkpoint the server serves, sharded with FSDP2: the user's own."""

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)

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

    def save_sent(self, folder: str) -> int:
        """Every tensor ModuleSource yields, full (each rank gathers its shards with the others), written
        by rank 0 as one safetensors file: what the IPC engine would hand the server's loader."""
        from safetensors.torch import save_file

        source = self.source()
        sent = dict(source.iter_full() if hasattr(source, "iter_full") else source)  # (vLLM 0.32: iterating it)
        if dist.get_rank() == 0:
            tensors = {name: t.detach().contiguous() for name, t in sent.items()}
            save_file(tensors, os.path.join(folder, "model.safetensors"))
        return len(sent)


def checksums(sock: str) -> dict:
    """vLLM's digest of every parameter the server holds (its own names, after its loader)."""
    return helpers.request(sock, "POST", "/weight_checker", json={"action": "checksum"})["checksums"]


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


def main(model_dir: str, serve_flags: list[str], launcher: list[str]) -> None:
    from safetensors import safe_open

    socket_path = str(Path(tempfile.mkdtemp(prefix="alone-")) / "vllm.sock")
    ray.init(address="local", num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False)
    try:  # the server starts while the trainers load and shard their model
        with helpers.serving([model_dir, *serve_flags], socket_path=socket_path, log_path="server.log",
                             launcher=tuple(launcher)) as server:  # fmt: skip
            trainers, _ = helpers.start_trainers(MyTrainer, 2, gpus_per_trainer=0, trainer_args=(model_dir,))
            helpers.ray_get_all([t.shard.remote() for t in trainers])
            metas = helpers.ray_get_all([t.metadata.remote() for t in trainers])
            print("ranks", [p["rank"] for p in helpers.placements(trainers)])
            print("same metadata on every rank:", metas[0] == metas[1])
            with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:  # what vLLM's loader read
                loaded = sorted((name, list(f.get_slice(name).get_shape())) for name in f.keys())
            print("ModuleSource's names and shapes are the loaded checkpoint's:",
                  sorted((name, shape) for name, shape, _ in metas[0]) == loaded, len(loaded))
            helpers.wait_until_healthy(server, timeout_s=300)
            print("watchdogs while serving:", len(watchdogs(socket_path)))
            sock = server.socket_path
            served, prompt = checksums(sock), ["The capital of France is"]
            before = helpers.completions(sock, "tiny", prompt, max_tokens=8)[0].token_ids
            # Rank 0's calls to vLLM's weight routes in a send, through helpers' client, with no chunk between
            # (the chunks' IPC handles need CUDA): the engine's reload starts and finishes, the weights stay.
            client = helpers.FailAfterSend(helpers.weight_sync_client(sock))
            client.init_weight_transfer_engine({"packed": True})
            client.start_weight_update()
            client.finish_weight_update()
            client.raise_failure()
            print("weight routes round trip, weights as served:", checksums(sock) == served)
            # The server's weights zeroed, then what ModuleSource yields loaded by vLLM's own loader (its
            # reload_weights, which IPC's receive_weights calls the same way: model.load_weights).
            helpers.request(sock, "POST", "/weight_checker", json={"action": "reset"})
            print("zeroed:", checksums(sock) != served)
            folder = tempfile.mkdtemp(prefix="sent-")
            counts = helpers.ray_get_all([t.save_sent.remote(folder) for t in trainers])
            helpers.request(sock, "POST", "/collective_rpc", json={"method": "reload_weights",
                                                                   "kwargs": {"weights_path": folder}})  # fmt: skip
            print("sent", counts, "loaded back by vLLM's loader, weights as served:", checksums(sock) == served)
            after = helpers.completions(sock, "tiny", prompt, max_tokens=8)[0].token_ids
            print("same greedy completion:", after == before, len(after))
        print("group left:", helpers.group_members(server.pgid))
        print("watchdogs left:", watchdogs(socket_path))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]))
