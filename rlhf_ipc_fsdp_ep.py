"""Move an FSDP2 trainer's weights into a colocated vLLM server over CUDA IPC.

N GPUs are shared by two parties:
  * N FSDP2 trainer ranks, one Ray actor per GPU (the model sharded over them);
  * one `vllm serve` with data parallel size N/TP and expert parallelism, its
    engines pinned to the same GPUs with --device-ids.

One sync, as an RL step does it:
  1. /sleep                     vLLM frees its KV cache (and its weights at level 2)
  2. /wake_up?tags=weights      vLLM maps its weight memory back
  3. send_weights() on every rank: vLLM's IPC trainer engine packs the
     weights into one GPU buffer per rank, and the vLLM engine on each GPU
     reads its own GPU's buffer through a CUDA IPC handle. With the default
     direct loader (direct_load.py) each GPU gets only its own experts, taken
     from the FSDP shard without a gather and copied into place in one piece
     per layer; --weight-loader vllm sends everything to vLLM's own route
  4. /wake_up?tags=kv_cache&tags=scheduling   vLLM serves again

Then the proof: vLLM's prompt log-probabilities on every DP rank must match the
trainer's own forward pass on the same tokens. With --train, each round first
takes one policy-gradient step while vLLM sleeps, as an RL loop does.

    python rlhf_ipc_fsdp_ep.py --model tiny --num-gpus 2      # no download
    python rlhf_ipc_fsdp_ep.py                                # Qwen3-30B-A3B on 4 GPUs
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import ray
import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import ModuleSource, ParamMeta, materialize_full_tensor

import helpers

HERE = Path(__file__).resolve().parent
GiB = 1024**3
DEFAULT_PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "The future of AI is",
    "Reinforcement learning from human feedback",
]


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--model",
        default="Qwen/Qwen3-30B-A3B",
        help="a Hugging Face model id (downloaded), a local model directory, or a "
        "random-weight model built locally with no download: 'tiny' (a small Qwen3-MoE) "
        "or 'qwen3-30b-a3b-shape' (Qwen3-30B-A3B's shapes)",
    )
    p.add_argument(
        "--num-gpus", type=int, default=4, help="GPUs to reserve through Ray; one trainer rank per GPU"
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="vLLM tensor parallel size; data parallel size is num-gpus / this, experts split over all GPUs",
    )
    p.add_argument(
        "--weight-loader",
        choices=("direct", "vllm"),
        default="direct",
        help="who loads the weights into vLLM. direct: the server's direct loader (direct_load.py); "
        "each GPU gets only its own experts, copied in one piece per layer (send 1.1-1.4 s for the "
        "30B-A3B shape on 2 H200). vllm: vLLM's own /update_weights route, one loader call per expert "
        "(26.6-27.5 s). direct needs --tensor-parallel-size 1 and an unquantized model",
    )
    p.add_argument(
        "--packed",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="pack parameters into one reusable IPC buffer per rank instead of one IPC handle per parameter",
    )
    p.add_argument(
        "--packed-buffer-size-bytes",
        type=int,
        default=GiB,
        help="size of each rank's packed IPC buffer; must hold the largest parameter",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.35,
        help="share of each GPU's memory vLLM may use; the rest is the trainer's",
    )
    p.add_argument("--port", type=int, default=8000, help="vLLM server port on 127.0.0.1")
    p.add_argument(
        "--sleep-level",
        type=int,
        choices=(1, 2),
        default=2,
        help="1: vLLM copies its weights to CPU memory while asleep; 2: it discards them. "
        "2 is safe here because every weight is re-sent, and it skips a full copy each way",
    )
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per prompt")
    p.add_argument(
        "--prompt",
        action="append",
        dest="prompts",
        metavar="TEXT",
        help=f"a prompt (repeatable); default: {DEFAULT_PROMPTS}",
    )
    p.add_argument("--rounds", type=int, default=1, help="weight syncs to run back to back")
    p.add_argument(
        "--logprob-mean-tolerance",
        type=float,
        default=0.1,
        help="largest accepted mean |trainer - vLLM| log-probability (nats) after a sync. "
        "Measured on H200 after a sync: 0.005-0.012 (tiny), 0.053-0.055 (30B-A3B shape); with "
        "vLLM's dummy weights: 0.58-1.29",
    )
    p.add_argument(
        "--logprob-max-tolerance",
        type=float,
        default=1.0,
        help="largest accepted single-token |trainer - vLLM| log-probability after a sync, a guard "
        "against gross errors. Measured: bf16 outliers up to 0.68 on sampled tokens with equal "
        "weights; 2.2-3.3 with dummy weights",
    )
    p.add_argument(
        "--train",
        action="store_true",
        help="each round: sample from vLLM, score with a toy reward, take one policy-gradient "
        "AdamW step while vLLM sleeps, then sync (the trainer keeps fp32 master weights)",
    )
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate (--train)")
    p.add_argument(
        "--samples-per-prompt", type=int, default=4, help="completions per prompt per round (--train)"
    )
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (--train)")
    p.add_argument(
        "--memory-growth-tolerance-gib",
        type=float,
        default=0.5,
        help="fail if GPU memory after a sync grows more than this from round 2 to the last",
    )
    p.add_argument(
        "--check-coverage",
        action="store_true",
        help="debug: before round 1, zero every vLLM parameter, sync, and fail unless every "
        "parameter on every DP rank was written (slow: vLLM hashes every tensor)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the summary as JSON here")
    p.add_argument(
        "--enforce-eager", action="store_true", help="passed to vllm serve (starts faster, generates slower)"
    )
    p.add_argument("--max-model-len", type=int, help="passed to vllm serve")
    p.add_argument("--server-log", default="vllm-server.log", help="where the server's output goes")
    p.add_argument(
        "--server-timeout", type=float, default=1200, help="seconds to wait for the server to become healthy"
    )
    p.add_argument(
        "--placement-timeout", type=float, default=60, help="seconds to wait for Ray to place the trainers"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (preset models)")
    args = p.parse_args(argv)
    args.prompts = args.prompts or DEFAULT_PROMPTS

    def fail(msg: str):
        p.error(msg)  # exits with status 2 and the usage line

    if args.num_gpus < 1:
        fail("--num-gpus must be at least 1")
    if args.tensor_parallel_size < 1 or args.num_gpus % args.tensor_parallel_size:
        fail(
            f"--num-gpus {args.num_gpus} is not divisible by --tensor-parallel-size "
            f"{args.tensor_parallel_size}"
        )
    if not 0 < args.gpu_memory_utilization < 1:
        fail("--gpu-memory-utilization must be between 0 and 1")
    if args.packed_buffer_size_bytes < 1:
        fail("--packed-buffer-size-bytes must be positive")
    if args.weight_loader == "direct" and not args.packed:
        fail("--weight-loader direct reads packed buffers: drop --no-packed or pass --weight-loader vllm")
    if args.weight_loader == "direct" and args.tensor_parallel_size != 1:
        fail("--weight-loader direct needs --tensor-parallel-size 1; pass --weight-loader vllm")
    if args.rounds < 1 or args.max_tokens < 1 or args.samples_per_prompt < 1:
        fail("--rounds, --max-tokens and --samples-per-prompt must be at least 1")
    return args


def resolve_model(model: str, workdir: Path) -> Path:
    """The model directory: built locally for a preset, as given for a path,
    downloaded for a Hugging Face id."""
    if model in helpers.MODEL_PRESETS:
        return helpers.build_preset_model(model, workdir / model)
    path = Path(model).expanduser()
    looks_local = path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1
    if looks_local:
        if not (path / "config.json").is_file():
            raise SystemExit(f"error: model path {model!r} has no config.json (does it exist?)")
        return path.resolve()
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model))
    except Exception as e:  # offline, unknown id, no access: all end here
        raise SystemExit(f"error: could not download {model!r}: {e}") from e


def check_before_gpu_work(args: argparse.Namespace, model_path: Path) -> None:
    """The input errors we can catch before anything touches a GPU."""
    if not helpers.port_is_free(args.port):
        raise SystemExit(f"error: port {args.port} on 127.0.0.1 is already in use; pass another --port")
    if args.packed:
        name, size = helpers.largest_parameter(model_path)
        if size > args.packed_buffer_size_bytes:
            raise SystemExit(
                f"error: --packed-buffer-size-bytes {args.packed_buffer_size_bytes} is smaller than "
                f"the largest parameter, {name} ({size} bytes); pass at least {size}"
            )
    if args.weight_loader == "direct":
        from transformers import AutoConfig

        experts = getattr(AutoConfig.from_pretrained(model_path), "num_experts", 0) or 0
        if experts % args.num_gpus:
            raise SystemExit(
                f"error: the model's {experts} experts do not split evenly over {args.num_gpus} GPUs, "
                "which --weight-loader direct needs; pass --weight-loader vllm"
            )


# ---------------------------------------------------------------------------
# The trainer: one FSDP2 rank per GPU
# ---------------------------------------------------------------------------


class PlacementError(RuntimeError):
    """Ray cannot give every trainer rank its GPU on one node."""


class TrainerDied(RuntimeError):
    """A trainer rank's process died (killed, out of memory, crashed)."""


class FSDPTrainer:
    """One FSDP2 rank. Started as a Ray actor by start_trainers()."""

    def __init__(self, rank: int, world_size: int, master_port: int, device_type: str = "cuda"):
        self.rank = rank
        if device_type == "cuda":
            torch.cuda.set_device(0)  # Ray made this actor's GPU the only visible one
            self.device = torch.device("cuda", 0)
            backend = "nccl"
        else:
            self.device = torch.device("cpu")
            backend = "gloo"
        # Loopback rendezvous: all ranks share one node (CUDA IPC needs that
        # anyway), and the node's own IP has hung the rendezvous on GPU hosts.
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{master_port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(minutes=10),
            device_id=self.device if device_type == "cuda" else None,
        )
        self.model = None
        self.engine = None

    def placement(self) -> dict:
        """Which GPU Ray gave this rank."""
        info = {
            "rank": self.rank,
            "pid": os.getpid(),
            "gpu_ids": [str(i) for i in ray.get_gpu_ids()],
            "node": ray.get_runtime_context().get_node_id(),
        }
        if self.device.type == "cuda":
            props = torch.cuda.get_device_properties(self.device)
            info.update(gpu_name=props.name, gpu_uuid=str(props.uuid))
        return info

    def build_model(self, model_path: str, random_init: bool, seed: int = 0, trainable: bool = False) -> int:
        """Build the model sharded from the start (never whole on one GPU);
        return the bytes one full sync moves (bf16).

        `trainable` keeps fp32 master weights (bf16 compute): AdamW steps of
        a realistic size vanish in bf16 weights. What vLLM gets is still bf16."""
        from transformers import AutoConfig, AutoModelForCausalLM
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        config = AutoConfig.from_pretrained(model_path)
        master_dtype = torch.float32 if trainable else torch.bfloat16
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=master_dtype)
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp_policy)
        fully_shard(model, mp_policy=mp_policy)
        model.to_empty(device=self.device)
        restore_rotary_tables(model)
        if random_init:
            init_random_weights(model, seed)
        else:
            load_pretrained_weights(model, model_path, self.rank)
        self.model = model
        self.optimizer = None
        return sum(p.numel() * torch.bfloat16.itemsize for p in model.parameters())

    def _token_logprobs(self, ids: list[int]) -> torch.Tensor:
        """log p(token_i | tokens_<i) for i >= 1, like vLLM's prompt_logprobs.
        Every rank must call it: FSDP gathers each layer during the forward."""
        x = torch.tensor([ids], device=self.device)
        logits = self.model(input_ids=x).logits[0, :-1].float()
        return torch.log_softmax(logits, dim=-1).gather(-1, x[0, 1:, None])[:, 0]

    @torch.no_grad()
    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        self.model.eval()
        return [self._token_logprobs(ids).tolist() for ids in sequences]

    def train_step(self, samples: list[dict], lr: float) -> float:
        """One policy-gradient (REINFORCE) step with AdamW on vLLM's samples:
        loss = -mean_i(advantage_i * mean log p(completion_i)). Every rank
        takes its share of the batch; FSDP averages the gradients. Each sample
        is {"prompt_ids", "completion_ids", "advantage"}. Returns the loss."""
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.model.train()
        world = dist.get_world_size()
        mine = samples[self.rank :: world]
        # Every rank must run the same number of forward passes (each one
        # all-gathers every layer): pad the short ranks with weight-0 samples.
        padding = -(-len(samples) // world) - len(mine)
        weights = [1.0] * len(mine) + [0.0] * padding
        mine = mine + samples[:1] * padding
        loss = torch.zeros((), device=self.device)
        for weight, sample in zip(weights, mine, strict=True):
            lp = self._token_logprobs(sample["prompt_ids"] + sample["completion_ids"])
            completion_lp = lp[len(sample["prompt_ids"]) - 1 :].mean()
            # Scaled so that FSDP's mean over ranks is the mean over the batch.
            loss = loss - weight * sample["advantage"] * completion_lp * world / len(samples)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)
        return total.item() / world

    def weight_source(self, loader: str = "vllm") -> "ModuleSource":
        """What vLLM receives, as bf16 whatever the master dtype: every
        parameter whole for vLLM's loader; for the direct loader, each rank's
        own experts and every other parameter whole."""
        if loader == "direct":
            return LocalExpertSource(self.model, dist.get_world_size())
        return BF16Source(self.model)

    def init_weight_transfer(
        self,
        url: str,
        loader: str,
        packed: bool,
        packed_buffer_size_bytes: int,
        trainer_gpu_uuids: list[str],
    ) -> None:
        """Build vLLM's IPC trainer engine on this rank. Its client (used on
        rank 0 only) talks to vLLM's weight routes or to the direct loader."""
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        if loader == "direct":
            client = helpers.DirectLoadClient(url, trainer_gpu_uuids)
        else:
            client = helpers.weight_sync_client(url)
        # Where a send's time goes, filled in by the wrappers (see send_weights).
        self.send_seconds: dict[str, float] = {}
        self.engine = WeightTransferTrainerFactory.trainer_init(
            IPCTrainerInitInfo(
                rank=self.rank, packed=packed, packed_buffer_size_bytes=packed_buffer_size_bytes
            ),
            client=helpers.TimedClient(client, self.send_seconds),
            source=helpers.TimedSource(self.weight_source(loader), self.send_seconds, self._synchronize),
        )

    def send_weights(self) -> dict[str, float]:
        """One full sync; every rank takes part. Returns once this GPU's work is
        done, with where this rank's time went: `source` (gathering and casting
        the tensors), `server_*` (waiting on the server, rank 0 only) and
        `total`; the rest is packing and the trainer ranks' handshakes."""
        self.send_seconds.clear()
        start = time.perf_counter()
        self.engine.send_weights()
        self._synchronize()
        return {**self.send_seconds, "total": time.perf_counter() - start}

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def memory_gib(self) -> dict:
        """This GPU's memory: the trainer's peak and reserved (PyTorch), what
        the other processes on it use (the vLLM engine; from NVML), and the
        device total in use."""
        free, total = torch.cuda.mem_get_info(self.device)
        return {
            "trainer_peak_allocated": torch.cuda.max_memory_allocated(self.device) / GiB,
            "trainer_reserved": torch.cuda.memory_reserved(self.device) / GiB,
            "server_used": helpers.other_processes_gpu_memory(
                str(torch.cuda.get_device_properties(self.device).uuid)
            )
            / GiB,
            "device_used": (total - free) / GiB,
        }


class BF16Source(ModuleSource):
    """vLLM's ModuleSource (one all-gather per parameter), cast to bf16: fp32
    master weights would double the bytes sent and overflow the packed buffer."""

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(m.name, torch.bfloat16, m.shape) for m in super().metadata()]

    def __iter__(self):
        for name, tensor in super().__iter__():
            yield name, tensor.to(torch.bfloat16)


class LocalExpertSource(BF16Source):
    """What the direct loader receives from one rank: every parameter whole
    (one all-gather each), except the fused expert tensors, of which each rank
    sends its own FSDP shard without any gather. FSDP2 shards dim 0, so rank r
    holds experts [r*E/N, (r+1)*E/N): the block vLLM's linear expert placement
    gives the engine on rank r's GPU. Every rank yields the same names and
    shapes, as vLLM's packed IPC producer requires."""

    EXPERT_SUFFIXES = (".experts.gate_up_proj", ".experts.down_proj")

    def __init__(self, module: torch.nn.Module, world_size: int) -> None:
        super().__init__(module)
        self._world_size = world_size
        for name, param in module.named_parameters():
            if self._is_local(name, param) and param.shape[0] % world_size:
                raise ValueError(
                    f"{name} has {param.shape[0]} experts, not divisible by {world_size} GPUs: "
                    "the direct loader needs an even split; pass --weight-loader vllm"
                )

    def _is_local(self, name: str, param: torch.Tensor) -> bool:
        return name.endswith(self.EXPERT_SUFFIXES) and hasattr(param, "to_local")

    def metadata(self) -> list[ParamMeta]:
        return [
            ParamMeta(name, torch.bfloat16, (p.shape[0] // self._world_size, *p.shape[1:]))
            if self._is_local(name, p)
            else ParamMeta(name, torch.bfloat16, tuple(p.shape))
            for name, p in self._module.named_parameters()
        ]

    def __iter__(self):
        for name, param in self._module.named_parameters():
            tensor = param.to_local() if self._is_local(name, param) else materialize_full_tensor(param)
            yield name, tensor.to(torch.bfloat16)


def restore_rotary_tables(model: torch.nn.Module) -> None:
    """to_empty() leaves buffers uninitialised; rebuild the rotary tables,
    the only buffers these decoders have."""
    for module in model.modules():
        if hasattr(module, "inv_freq"):
            fresh = type(module)(module.config)
            for name, buf in fresh.named_buffers(recurse=False):
                getattr(module, name).copy_(buf)


@torch.no_grad()
def init_random_weights(model: torch.nn.Module, seed: int) -> None:
    """Random weights with a real spread of logits (unlike vLLM's dummy
    weights, which are near zero), so a missed sync shows in the gate.
    Each rank fills its own shard; norms get 1."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    for i, (name, param) in enumerate(model.named_parameters()):
        local = param.to_local() if hasattr(param, "to_local") else param
        if "norm" in name:
            local.fill_(1.0)
            continue
        gen = torch.Generator(device=local.device)
        gen.manual_seed(seed * 1_000_003 + i * 101 + rank)
        std = 1.0 if "embed_tokens" in name else param.shape[-1] ** -0.5
        local.normal_(0.0, std, generator=gen)


def load_pretrained_weights(model: torch.nn.Module, model_path: str, rank: int) -> None:
    """Rank 0 reads the checkpoint into CPU memory and broadcasts; each rank
    keeps only its shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import AutoModelForCausalLM

    full = {}
    if rank == 0:
        full = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).state_dict()
    set_model_state_dict(
        model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )


def start_trainers(
    num_trainers: int,
    gpus_per_trainer: float = 1,
    device_type: str = "cuda",
    placement_timeout_s: float = 60,
    trainer_cls: type | None = None,
) -> list:
    """Reserve one GPU per trainer rank on one node and start the ranks (as
    `trainer_cls`, default FSDPTrainer: pass your own subclass to change it).

    Raises PlacementError if Ray cannot place them in time (too few GPUs)."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    have = ray.cluster_resources().get("GPU", 0)
    if gpus_per_trainer and have < num_trainers * gpus_per_trainer:
        raise PlacementError(f"asked for {num_trainers} GPUs but the Ray cluster has {have:g}")
    bundle = {"CPU": 1, **({"GPU": gpus_per_trainer} if gpus_per_trainer else {})}
    # STRICT_PACK: CUDA IPC only works between processes on one machine.
    pg = placement_group([bundle] * num_trainers, strategy="STRICT_PACK")
    if not pg.wait(timeout_seconds=placement_timeout_s):
        ray.util.remove_placement_group(pg)
        raise PlacementError(
            f"Ray could not place {num_trainers} trainers with {bundle} each on one node "
            f"within {placement_timeout_s:.0f}s; cluster resources: {ray.cluster_resources()}"
        )
    master_port = helpers.free_port()
    actor_cls = ray.remote(trainer_cls or FSDPTrainer)
    return [
        actor_cls.options(
            num_cpus=1,
            num_gpus=gpus_per_trainer,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank),
        ).remote(rank, num_trainers, master_port, device_type)
        for rank in range(num_trainers)
    ]


def ray_get_all(refs: list):
    """ray.get(refs), but raise as soon as any one fails: the others may be
    blocked in a collective waiting for it, and would hang ray.get. A rank's
    ServerError (the server refused or died) is raised as itself, a dead rank
    as TrainerDied."""
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(done[0])
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, helpers.ServerError):
                raise helpers.ServerError(f"a trainer rank: {e.cause}") from None
            raise
        except ray.exceptions.RayActorError as e:
            raise TrainerDied(f"a trainer rank's process died: {str(e).splitlines()[0]}") from e
    return ray.get(refs)


def send_all(trainers: list) -> list[dict]:
    """send_weights() on every rank; returns each rank's time breakdown. If
    one rank fails, the others may wait for it in a collective: raise at once.
    vLLM then holds some new and some old weights, and is still asleep: the
    caller must not serve from it (main() stops it on the way out)."""
    try:
        return ray_get_all([t.send_weights.remote() for t in trainers])
    except helpers.ServerError as e:
        raise helpers.ServerError(
            f"the send failed part way; vLLM holds a mix of old and new weights: {e}"
        ) from None


# ---------------------------------------------------------------------------
# The server and the sync
# ---------------------------------------------------------------------------


def serve_args(args: argparse.Namespace, model_path: Path, served_name: str, gpu_ids: list[str]) -> list[str]:
    """`vllm serve` flags: one DP engine per TP group, experts split over
    every GPU, memory it can release while the trainer works."""
    # fmt: off
    flags = [
        str(model_path),
        "--served-model-name", served_name,
        "--tensor-parallel-size", str(args.tensor_parallel_size),
        "--data-parallel-size", str(args.num_gpus // args.tensor_parallel_size),
        "--enable-expert-parallel",
        "--device-ids", ",".join(gpu_ids),
        "--enable-sleep-mode",
        "--load-format", "dummy",  # the trainer sends the real weights
        "--weight-transfer-config", json.dumps({"backend": "ipc"}),
        # The direct loader, reached through /collective_rpc (see direct_load.py).
        "--worker-extension-cls", "direct_load.DirectLoadWorker",
        "--gpu-memory-utilization", str(args.gpu_memory_utilization),
    ]
    # fmt: on
    if args.enforce_eager:
        flags.append("--enforce-eager")
    if args.max_model_len:
        flags += ["--max-model-len", str(args.max_model_len)]
    return flags


@dataclass
class Sync:
    phases: dict[str, float]  # seconds per phase
    send_per_rank: list[dict]  # where each rank's send time went (FSDPTrainer.send_weights)
    trained: object = None  # what while_asleep returned


def sync_weights(url: str, trainers: list, sleep_level: int, while_asleep=None) -> Sync:
    """One sync: sleep, [while_asleep(), e.g. a training step], wake weights,
    send, wake KV cache and scheduling."""
    timer = helpers.PhaseTimer()
    with timer.phase("sleep"):
        helpers.sleep(url, sleep_level)
    trained = None
    if while_asleep is not None:
        with timer.phase("train"):
            trained = while_asleep()
    with timer.phase("wake_weights"):
        helpers.wake_up(url, ["weights"])
    with timer.phase("send"):
        send_per_rank = send_all(trainers)
    with timer.phase("wake_kv"):
        wake_for_serving(url)
    return Sync(timer.seconds, send_per_rank, trained)


def wake_for_serving(url: str) -> None:
    """Wake the KV cache and the scheduler; the server must then be fully awake."""
    state = helpers.wake_up(url, ["kv_cache", "scheduling"])
    if state["status"] != "awake":
        raise helpers.ServerError(f"server still asleep after the last wake_up: {state}")


def wake_zeroed_weights(url: str, sleep_level: int) -> None:
    """The first half of a sync, with every vLLM parameter on every DP rank
    zeroed before the send: what the sync then fails to write stays zero."""
    helpers.sleep(url, sleep_level)
    helpers.wake_up(url, ["weights"])
    helpers.weight_checker(url, "reset")


def check_sync_coverage(url: str, trainers: list, sleep_level: int) -> dict:
    """Zero every vLLM parameter on every DP rank, sync, and list the ones the
    sync did not write (vLLM's /weight_checker; slow: it hashes every tensor)."""
    wake_zeroed_weights(url, sleep_level)
    zeros = helpers.weight_checker(url, "checksum")["checksums"]
    send_all(trainers)
    written = set(helpers.weight_checker(url, "compare", baseline=zeros)["mismatches"])
    wake_for_serving(url)
    return {"parameters": len(zeros), "unwritten": sorted(set(zeros) - written)}


def logprob_gap(url: str, model: str, trainers: list, sequences: list[list[int]], dp_size: int) -> dict:
    """Compare the trainer's log-probabilities with each DP engine's. Every
    DP engine holds different experts, so each one is asked."""
    trainer_lps = ray_get_all([t.prompt_logprobs.remote(sequences) for t in trainers])[0]
    server_lps = [
        [helpers.prompt_logprobs(url, model, seq, dp_rank=dp_rank) for seq in sequences]
        for dp_rank in range(dp_size)
    ]
    per_rank = [helpers.logprob_diff(trainer_lps, lps) for lps in server_lps]
    return {
        "max_abs": max(d.max_abs for d in per_rank),
        "mean_abs": sum(d.mean_abs for d in per_rank) / len(per_rank),
        "max_abs_per_dp_rank": [d.max_abs for d in per_rank],
        "server": server_lps,
    }


def gate_tolerances(args: argparse.Namespace) -> dict[str, float]:
    return {"mean": args.logprob_mean_tolerance, "max": args.logprob_max_tolerance}


def gated_sync(
    job: Job, args: argparse.Namespace, sequences: list[list[int]], weights_updated: bool, while_asleep=None
) -> tuple[dict, Sync]:
    """One sync between two logprob measurements on `sequences`, and the
    round's record (round_record) with the memory after it."""
    url = job.server.url
    before = logprob_gap(url, job.served_name, job.trainers, sequences, job.dp_size)
    sync = sync_weights(url, job.trainers, args.sleep_level, while_asleep=while_asleep)
    after = logprob_gap(url, job.served_name, job.trainers, sequences, job.dp_size)
    memory = ray_get_all([t.memory_gib.remote() for t in job.trainers])
    record = round_record(
        sync, job.bytes_per_sync, before, after, gate_tolerances(args), memory, weights_updated
    )
    return record, sync


def train_all_ranks(trainers: list, samples: list[dict], lr: float) -> float:
    """FSDPTrainer.train_step on every rank; returns the loss."""
    return ray_get_all([t.train_step.remote(samples, lr) for t in trainers])[0]


def reward(text: str) -> float:
    """The toy task: write plain words. The share of characters that are a-z
    or a space (0 for an empty completion). Replace with your own."""
    if not text:
        return 0.0
    return sum(("a" <= c <= "z") or c == " " for c in text) / len(text)


def training_samples(batch: list[helpers.Completion]) -> tuple[list[dict], float]:
    """Samples for FSDPTrainer.train_step, with advantage = reward - batch mean
    (REINFORCE with a mean baseline); also returns the mean reward."""
    rewards = [reward(c.text) for c in batch]
    mean = sum(rewards) / len(rewards)
    samples = [
        {"prompt_ids": c.prompt_token_ids, "completion_ids": c.token_ids, "advantage": r - mean}
        for c, r in zip(batch, rewards, strict=True)
        if c.token_ids
    ]
    return samples, mean


def print_texts(label: str, prompts: list[str], batch: list[helpers.Completion]) -> None:
    print(f"--- {label} ---")
    # With --train the batch holds several samples per prompt; the first of each is shown.
    for prompt, out in zip(prompts, batch, strict=False):
        print(f"{prompt!r} -> {out.text!r}")


# ---------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------


@dataclass
class Job:
    """What colocated_job() started: the trainer ranks with the model sharded
    over them, and the vLLM server on the same GPUs."""

    trainers: list
    server: helpers.Server
    served_name: str
    dp_size: int
    gpu_name: str
    gpu_uuids: list[str]
    bytes_per_sync: int
    server_start_s: float


@contextmanager
def colocated_job(args: argparse.Namespace):
    """Reserve the GPUs, start a trainer rank on each with the model sharded
    over them, start `vllm serve` on the same GPUs; on exit (error, Ctrl-C or
    SIGTERM included) stop the server's whole process group and Ray."""
    # SIGTERM unwinds like Ctrl-C, so the finally block below always runs.
    previous_sigterm = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    workdir = Path(tempfile.mkdtemp(prefix="rlhf-ipc-"))  # built models live here
    server = None
    try:
        model_path = resolve_model(args.model, workdir)
        check_before_gpu_work(args, model_path)
        ray.init(include_dashboard=False)

        print(f"[trainers] reserving {args.num_gpus} GPUs through Ray", flush=True)
        trainers = start_trainers(args.num_gpus, placement_timeout_s=args.placement_timeout)
        placements = ray_get_all([t.placement.remote() for t in trainers])
        gpu_ids = [p["gpu_ids"][0] for p in placements]
        print(f"[trainers] rank -> GPU: {gpu_ids} ({placements[0]['gpu_name']})", flush=True)
        random_init = args.model in helpers.MODEL_PRESETS
        bytes_per_sync = ray_get_all(
            [t.build_model.remote(str(model_path), random_init, args.seed, args.train) for t in trainers]
        )[0]
        print(
            f"[trainers] model sharded over {args.num_gpus} ranks: {bytes_per_sync / 1e9:.3f} GB", flush=True
        )

        print(f"[server] starting vllm serve; log: {args.server_log}", flush=True)
        server = helpers.start_server(
            serve_args(args, model_path, args.model, gpu_ids),
            port=args.port,
            log_path=args.server_log,
            # The server's workers import the direct loader (direct_load.py) from here.
            env={"PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))},
        )
        server_start_s = helpers.wait_until_healthy(server, timeout_s=args.server_timeout)
        print(f"[server] healthy after {server_start_s:.1f} s at {server.url}", flush=True)
        yield Job(
            trainers=trainers,
            server=server,
            served_name=args.model,
            dp_size=args.num_gpus // args.tensor_parallel_size,
            gpu_name=placements[0]["gpu_name"],
            gpu_uuids=[p["gpu_uuid"] for p in placements],
            bytes_per_sync=bytes_per_sync,
            server_start_s=server_start_s,
        )
    finally:
        if server is not None:
            if server.proc.poll() is not None:
                print(
                    f"[shutdown] the vLLM server had exited with code {server.proc.returncode}; "
                    f"last lines of {server.log_path}:\n{helpers.log_tail(server, 15)}",
                    flush=True,
                )
            print("[shutdown] stopping the vLLM server", flush=True)
            helpers.stop_server(server)
        ray.shutdown()
        shutil.rmtree(workdir, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous_sigterm)


def init_weight_transfer(job: Job, args: argparse.Namespace, loader: str) -> None:
    """Every trainer rank builds vLLM's IPC trainer engine for `loader`."""
    ray_get_all(
        [
            t.init_weight_transfer.remote(
                job.server.url, loader, args.packed, args.packed_buffer_size_bytes, job.gpu_uuids
            )
            for t in job.trainers
        ]
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with colocated_job(args) as job:
        url, trainers = job.server.url, job.trainers
        init_weight_transfer(job, args, args.weight_loader)
        coverage = None
        if args.check_coverage:
            coverage = check_sync_coverage(url, trainers, args.sleep_level)
            print(
                f"[coverage] {coverage['parameters']} vLLM parameters, unwritten: {coverage['unwritten']}",
                flush=True,
            )

        # Training samples several completions per prompt; otherwise one greedy each.
        prompts = args.prompts * (args.samples_per_prompt if args.train else 1)
        temperature = args.temperature if args.train else 0.0
        vllm_has_trainer_weights = coverage is not None  # the coverage check synced once
        rounds = []
        for i in range(1, args.rounds + 1):
            print(f"=== round {i}/{args.rounds} ===", flush=True)
            batch = helpers.completions(
                url, job.served_name, prompts, args.max_tokens, temperature=temperature
            )
            if i == 1:
                print_texts("round 1, before its sync", args.prompts, batch)
            sequences = [c.prompt_token_ids + c.token_ids for c in batch]
            train_step, reward_mean = None, None
            if args.train:
                samples, reward_mean = training_samples(batch)
                train_step = functools.partial(train_all_ranks, trainers, samples, args.lr)
            # The first sync replaces vLLM's dummy weights; after that only training changes them.
            weights_updated = args.train or not vllm_has_trainer_weights
            vllm_has_trainer_weights = True
            record, sync = gated_sync(job, args, sequences, weights_updated, while_asleep=train_step)
            if args.train:
                record.update(reward_mean=reward_mean, loss=sync.trained)
            rounds.append(record)
            print_round(record, gate_tolerances(args))
        print_texts(
            "after the last sync",
            args.prompts,
            helpers.completions(url, job.served_name, args.prompts, args.max_tokens),
        )

        result = {
            **run_facts(job, args),
            "train": args.train,
            "coverage": coverage,
            "rounds": rounds,
            "memory_gib_per_rank": rounds[-1]["memory_gib_per_rank"],
            "memory_growth_gib": memory_growth_gib(rounds),
        }
        print(helpers.format_summary(result))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
            print(f"[json] {args.json}")
        failures = failed_checks(result, args.memory_growth_tolerance_gib)
        for failure in failures:
            print(f"FAILED: {failure}", file=sys.stderr)
        return 1 if failures else 0


def run_facts(job: Job, args: argparse.Namespace) -> dict:
    """What a reader needs to reproduce a result: hardware, versions, command, settings."""
    return {
        "gpu_name": job.gpu_name,
        "num_gpus": args.num_gpus,
        "tensor_parallel_size": args.tensor_parallel_size,
        "data_parallel_size": job.dp_size,
        "model": args.model,
        "vllm_version": vllm_version(),
        "torch_version": torch.__version__,
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%d"),
        "weight_loader": args.weight_loader,
        "packed": args.packed,
        "packed_buffer_size_bytes": args.packed_buffer_size_bytes,
        "sleep_level": args.sleep_level,
        "server_start_s": job.server_start_s,
    }


# ---------------------------------------------------------------------------
# Bookkeeping
# ---------------------------------------------------------------------------


def round_record(
    sync: Sync,
    bytes_sent: int,
    before: dict,
    after: dict,
    tolerances: dict,
    memory: list[dict],
    weights_updated: bool,
) -> dict:
    """One round's numbers, as they go into the JSON. `sync` is what
    sync_weights returned; `bytes_sent` the bf16 size of the model (what one
    trainer's model holds, whichever loader moves it). `before`/`after` are
    logprob_gap() results on the same token sequences; `tolerances` has the
    "mean" and "max" bounds; `weights_updated` says whether vLLM should now
    hold other weights than before the sync.

    The gate is on the mean: single sampled tokens differ by up to ~0.7 nats
    in bf16 even with equal weights, while wrong weights move every token."""
    # A sync that silently did nothing leaves vLLM's log-probabilities exactly
    # as they were. (Asked of vLLM only: its outputs repeat bit for bit on the
    # same weights, while the trainer's HF MoE forward need not.)
    server_changed = before["server"] != after["server"]
    phases = sync.phases
    return {
        "phases_s": phases,
        "send_breakdown_s": sync.send_per_rank,
        "cycle_s": sum(phases[p] for p in helpers.SYNC_PHASES),
        "bytes_sent": bytes_sent,
        "send_gb_per_s": bytes_sent / phases["send"] / 1e9,
        "max_abs_dlogp_before": before["max_abs"],
        "mean_abs_dlogp_before": before["mean_abs"],
        "max_abs_dlogp_after": after["max_abs"],
        "mean_abs_dlogp_after": after["mean_abs"],
        "max_abs_dlogp_after_per_dp_rank": after["max_abs_per_dp_rank"],
        "weights_updated": weights_updated,
        "logprobs_changed": server_changed,
        # `<=` is False for NaN, so a NaN never passes.
        "gate_passed": after["mean_abs"] <= tolerances["mean"]
        and after["max_abs"] <= tolerances["max"]
        and (server_changed or not weights_updated),
        "mem_reserved_gib": [m["trainer_reserved"] for m in memory],
        "memory_gib_per_rank": memory,
    }


def print_round(record: dict, tolerances: dict) -> None:
    changed = "vLLM logprobs changed" if record["logprobs_changed"] else "vLLM logprobs unchanged"
    if record["weights_updated"] and not record["logprobs_changed"]:
        changed += (
            " although the weights were updated (a sync that did nothing, or a step too small "
            "to change a bf16 weight)"
        )
    reward_text = f", reward {record['reward_mean']:.3f}" if "reward_mean" in record else ""
    print(
        f"[gate] |dlogp| mean {record['mean_abs_dlogp_before']:.4f} before -> "
        f"{record['mean_abs_dlogp_after']:.4f} after (tolerance {tolerances['mean']}), max "
        f"{record['max_abs_dlogp_before']:.4f} -> {record['max_abs_dlogp_after']:.4f} "
        f"(tolerance {tolerances['max']}), {changed}{reward_text}: "
        f"{'pass' if record['gate_passed'] else 'FAIL'}",
        flush=True,
    )


def memory_growth_gib(rounds: list[dict]) -> float:
    """Largest growth, on any GPU, of the memory used by all processes after a
    sync, from round 2 to the last round. Round 1 is left out: it allocates
    what every later round reuses (optimizer state, IPC buffer, NCCL buffers)."""
    if len(rounds) < 3:
        return 0.0
    first, last = rounds[1]["memory_gib_per_rank"], rounds[-1]["memory_gib_per_rank"]
    return max(b["device_used"] - a["device_used"] for a, b in zip(first, last, strict=True))


def failed_checks(result: dict, memory_tolerance_gib: float) -> list[str]:
    failures = [f"round {i}: logprob gate" for i, r in enumerate(result["rounds"], 1) if not r["gate_passed"]]
    if result["coverage"] and result["coverage"]["unwritten"]:
        failures.append(f"the sync did not write {len(result['coverage']['unwritten'])} vLLM parameters")
    if not result["memory_growth_gib"] <= memory_tolerance_gib:
        failures.append(
            f"GPU memory grew {result['memory_growth_gib']:.2f} GiB from round 2 to the last "
            f"(tolerance {memory_tolerance_gib} GiB)"
        )
    return failures


def vllm_version() -> str:
    import vllm

    return vllm.__version__


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (PlacementError, TrainerDied, helpers.ServerError) as e:
        # Expected failures get one clear line; anything else keeps its traceback.
        sys.exit(f"error: {e}")
