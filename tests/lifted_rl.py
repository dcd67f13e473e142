# SPDX-License-Identifier: Apache-2.0
"""A user's own RL code around the lifted files alone (tests/test_copy.py
copies it beside them into an empty folder and runs it there, with nothing
else of this project importable): an FSDP2 trainer class of its own (its own
constructor, no base class of ours) as 2 Ray ranks on gloo, the weight
sources over FSDP2, a vLLM server started through the lift, and the direct
loader's check before any send.

    python lifted_rl.py MODEL_DIR SERVE_FLAGS_JSON LAUNCHER_JSON
"""

import atexit
import json
import shutil
import sys
import tempfile
from pathlib import Path

import ray
import torch
import torch.distributed as dist

import helpers
from weight_sync import ray_trainers, sources


class MyTrainer:
    """Built from a config, sharded with FSDP2: the user's own."""

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.bfloat16)

    def shard(self) -> None:  # once start_trainers has joined the ranks in one process group
        from torch.distributed.fsdp import fully_shard

        for layer in self.model.model.layers:
            fully_shard(layer)
        fully_shard(self.model)

    def source_form(self) -> list:
        """What this rank's direct-loader source sends: (name, shape) of each tensor, and the expert blocks."""
        source = sources.weight_source(self.model, dist.get_world_size(), "direct")
        sent = [(name, list(tensor.shape)) for name, tensor in source.tensors()]
        return [sent, {name: list(shape) for name, shape in source.expert_blocks.items()}]

    def check_before_send(self, sock: str, gpu_uuids: list[str]) -> str:
        """What weight_sender's vLLM IPC trainer engine first does on rank 0
        (which it cannot be built without a GPU): the direct loader checks,
        on every engine, the expert blocks this source will send."""
        source = sources.weight_source(self.model, dist.get_world_size(), "direct")
        client = sources.sync_client(sock, "direct", source, gpu_uuids)
        try:
            client.init_weight_transfer_engine({"packed": True})
        except helpers.ServerError as e:
            return f"refused: {e}"
        return "passed"


def main(model_dir: str, serve_flags: list[str], launcher: list[str]) -> None:
    socket_path = Path(tempfile.mkdtemp(prefix="lifted-")) / "vllm.sock"
    atexit.register(shutil.rmtree, socket_path.parent, ignore_errors=True)
    ray.init(address="local", num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False)
    try:  # the server starts while the trainers build their models, as in the script
        with helpers.serving(
            [model_dir, *serve_flags], socket_path=socket_path, log_path="server.log", launcher=tuple(launcher)
        ) as server:
            trainers, _ = ray_trainers.start_trainers(MyTrainer, 2, gpus_per_trainer=0, trainer_args=(model_dir,))
            ray_trainers.ray_get_all([t.shard.remote() for t in trainers])
            forms = ray_trainers.ray_get_all([t.source_form.remote() for t in trainers])
            print("ranks", [p["rank"] for p in ray_trainers.placements(trainers)])
            print("same names and shapes on every rank:", forms[0] == forms[1])
            print("expert blocks:", json.dumps(forms[0][1], sort_keys=True))
            helpers.wait_until_healthy(server, timeout_s=300)
            sock = str(server.socket_path)
            # The server has one engine (its GPU id is "" on CPU): one rank per engine (here the driver,
            # unsharded) passes; two ranks each send half of the experts that engine holds whole, which it
            # refuses before any send.
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            print("one rank:", MyTrainer(model_dir).check_before_send(sock, [""]))
            two = ray_trainers.ray_get_all([t.check_before_send.remote(sock, ["", "GPU-1"]) for t in trainers])
            print("two ranks:", two[0].replace("\n", " ")[:300])
            print("health:", helpers.health(sock))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]))
