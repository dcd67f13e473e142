# SPDX-License-Identifier: Apache-2.0
"""Move an FSDP2 trainer's weights into a colocated vLLM server over CUDA IPC.

N FSDP2 trainer ranks, one Ray actor per GPU, share their N GPUs with one
`vllm serve` that runs N / TP data-parallel engines with expert parallelism.
The server listens on a Unix socket in a private directory, so only this user
can reach it. main() starts the job, checks that the server's vLLM has what
the loader needs, sets up the transfer on every rank, generates, and runs the
rounds. run_round() does steps 1-6 of each round; the proof in proof/rounds.py
wraps every step and does step 7 after the round:

  1. generate                               vLLM samples; the trainer and vLLM score the tokens
  2. /sleep?level=0                         vLLM pauses; with --train it frees its KV cache for the
     + /release_kv_cache_memory             step, else it resets its prefix cache beside the send; its
                                            weights stay on the GPU unless --sleep-level is 1 or 2
  3. train                                  with --train: one policy-gradient step in the freed memory
  4. /wake_up?tags=weights                  at --sleep-level 1 and 2 only: vLLM maps its weights back
  5. send_weights() on every rank           vLLM's IPC trainer engine; each engine reads the buffer on
                                            its own GPU, and the direct loader sends it its own experts;
                                            then each rank empties PyTorch's cache if vLLM freed its KV cache
  6. /wake_up?tags=kv_cache&tags=scheduling vLLM serves again, after its prefix cache's reset
  7. exact check and gate                   every DP engine holds what its GPU's trainer rank sent, bit
                                            for bit, and vLLM's logprobs on every engine match the trainer's

    python rlhf_ipc_fsdp_ep.py --model tiny --num-gpus 2      # no download
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import ray
import torch
import torch.distributed as dist

import helpers
from proof import preflight, program, toy_rl
from proof.rounds import Proof, RoundProof
from weight_sync import generation, models, sources, vllm_adapter
from weight_sync.multinode import (
    TCPRendezvous,
    free_port,
    gloo_interface_env,
    raise_node_failure,
    start_node_servers,
    stop_node_servers,
)
from weight_sync.ray_trainers import leave_ray, placements, ray_get_all, send_all, start_trainers, wait_until_ready
from weight_sync.vllm_adapter import DIRECT_LOADER, loader_choice, untested_vllm_warning

HERE = Path(__file__).resolve().parent
DEFAULT_PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "The future of AI is",
    "Reinforcement learning from human feedback",
]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add = p.add_argument
    add(
        "--model",
        default="Qwen/Qwen3-30B-A3B",
        help="a Hugging Face id (downloaded), a local "
        f"directory, or a random-weight model built locally: {', '.join(models.PRESETS)}",
    )
    add("--num-gpus", type=int, default=4, help="GPUs to reserve through Ray, in all; one trainer rank per GPU")
    add(
        "--num-nodes",
        type=int,
        default=1,
        help="nodes the GPUs are on, as many on each; the first is this one. "
        "One vLLM server spans them: its DP engines and experts cover every GPU (docs/SCALING.md)",
    )
    add("--tensor-parallel-size", type=int, default=1, help="vLLM TP; data parallel size is num-gpus / this")
    add(
        "--weight-loader",
        choices=("direct", "vllm"),
        help="direct (the default): the server's direct "
        "loader (direct_load.py), each GPU gets its own experts in one copy per layer; vllm: vLLM's "
        "/update_weights route. direct needs --tensor-parallel-size 1. Left out, vLLM's loader where the "
        "installed vLLM lacks what the direct loader needs (weight_sync/vllm_adapter.py), saying so",
    )
    add(
        "--rollout-dtype",
        choices=("bf16", "fp8"),
        default="bf16",
        help="what vLLM serves the routed experts in: "
        "fp8: block-wise e4m3 with a scale per 128 x 128 block, quantized from the trainer's bf16 at every sync "
        "(the rest stays bf16); the trainer keeps its own dtype",
    )
    add(
        "--packed",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="pack parameters into one reusable IPC buffer per rank (else one IPC handle per parameter)",
    )
    add(
        "--packed-buffer-size-bytes",
        type=int,
        default=4 * 1024**3,
        help="each rank's packed IPC buffer; "
        "must hold the largest parameter (fewer, larger chunks: a faster send, for that much trainer memory)",
    )
    add(
        "--send-retries",
        type=int,
        default=1,
        help="direct loader: send again from the start, this many "
        "times, when the server fails a send part way (vLLM stays asleep; a dead server or trainer is not retried)",
    )
    add("--gpu-memory-utilization", type=float, default=0.35, help="vLLM's share of each GPU's memory")
    add(
        "--kv-cache-tokens",
        type=int,
        help="each engine's KV cache, in tokens (default: two sequences of "
        "--max-model-len or the model's context; 0: what --gpu-memory-utilization leaves). Every sync resets "
        "vLLM's prefix cache, a loop over the cache's blocks: a cache sized for the batch keeps that short",
    )
    add(
        "--kv-cache-memory-bytes",
        type=int,
        help="passed to vllm serve: each GPU's KV cache in bytes, instead "
        "of --kv-cache-tokens (vLLM skips its memory profiling then, so servers on one GPU can start side by side)",
    )
    add(
        "--sleep-level",
        type=int,
        choices=(0, 1, 2),
        default=0,
        help="what vLLM frees for the trainer: "
        "0: its KV cache at most (--free-kv-cache; the fastest: its weights stay on the GPU beside the "
        "trainer's and are overwritten in place); 1: the KV cache and the weights, copied to CPU; 2: the KV "
        "cache and the weights, discarded (the send rewrites every one)",
    )
    add(
        "--free-kv-cache",
        action=argparse.BooleanOptionalAction,
        help="at --sleep-level 0, give the KV "
        "cache's memory to the trainer during the sync (default: with --train only; releasing and mapping "
        "back a large cache costs more than the send on small models)",
    )
    add("--max-tokens", type=int, default=16, help="tokens generated per prompt")
    add("--prompt", action="append", dest="prompts", metavar="TEXT", help=f"repeatable; default {DEFAULT_PROMPTS}")
    add("--rounds", type=int, default=1, help="rounds (one sync each) back to back")
    add(
        "--soak-seconds",
        type=float,
        default=0,
        help="a soak: after --rounds, more rounds until this many seconds have passed since the first began",
    )
    toy_rl.add_arguments(p)  # --train, --lr, --samples-per-prompt, --temperature
    preflight.add_arguments(p)  # the gate's tolerances, --check-coverage, --json
    add("--enforce-eager", action="store_true", help="passed to vllm serve (starts faster, generates slower)")
    add("--max-model-len", type=int, help="passed to vllm serve")
    add("--server-log", default="vllm-server.log", help="where the server's output goes")
    add("--server-timeout", type=float, default=1200, help="seconds to wait for the server to be healthy")
    add("--placement-timeout", type=float, default=60, help="seconds to wait for Ray to place the trainers")
    add("--seed", type=int, default=0, help="seed of the random weights (preset models)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    args.prompts = args.prompts or DEFAULT_PROMPTS
    args.weight_loader, args.weight_loader_reason = loader_choice(args.weight_loader, args.rollout_dtype == "fp8")
    if args.weight_loader_reason not in ("the default", "asked for"):
        print(f"[sync] {args.weight_loader_reason}", flush=True)
    if problem := preflight.flag_problem(args):
        p.error(problem)
    if warning := untested_vllm_warning():
        print(warning, flush=True)
    return args


# --- The trainer: one FSDP2 rank per GPU ----------------------------------------------------------


class FSDPTrainer:
    """One FSDP2 rank on one GPU, run as a Ray actor; ray_trainers.start_trainers starts one per GPU."""

    model = optimizer = sender = None

    def __init__(self) -> None:
        # Ray made this rank's GPU the only one visible.
        self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    def build_model(self, model_path: str, lr: float | None = None) -> None:
        """Allocate the model sharded from the start, never whole on one GPU; init_weights() fills it.

        With `lr`, for training, keep fp32 master weights and compute in bf16: AdamW steps of a realistic size
        vanish in bf16."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        model = models.meta_model(model_path, torch.bfloat16 if lr is None else torch.float32)
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for name in {name.rpartition(".")[0] for name in sources.fused_expert_tensors(model)}:
            # Give the experts their own FSDP unit, so a sync gathers a layer's other weights in one all-gather
            # without them: LocalExpertSource sends each rank's own experts as they are.
            fully_shard(model.get_submodule(name), mp_policy=mp_policy)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp_policy)
        fully_shard(model, mp_policy=mp_policy)
        model.to_empty(device=self.device)
        models.restore_rotary_tables(model)
        self.model, self.lr = model, lr

    def init_weights(self, model_path: str, random_init: bool, seed: int = 0) -> int:
        """Fill the model with random weights for a preset, or with this rank's shards of the checkpoint.

        For training, build AdamW afterwards. Return the bytes read from the checkpoint."""
        read = 0
        if random_init:
            models.init_random_weights(self.model, seed)
        else:
            read = models.load_pretrained_weights(self.model, model_path)
        if self.lr is not None:
            # Build it now, while every parameter is a shard. After a forward, FSDP2 leaves the root's own
            # parameters, such as the embeddings and lm_head, unsharded, and an optimizer built then would
            # hold copies that never receive a gradient.
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.lr, weight_decay=0.0)
        return read

    def _token_logprobs(self, ids: list[int]) -> torch.Tensor:
        """Return log p(token_i | tokens before i) for i >= 1, like vLLM's prompt_logprobs.

        Every rank must call it, since FSDP gathers each layer during the forward."""
        x = torch.tensor([ids], device=self.device)
        logits = self.model(input_ids=x).logits[0, :-1].float()
        return torch.log_softmax(logits, dim=-1).gather(-1, x[0, 1:, None])[:, 0]

    @torch.no_grad()
    def token_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        self.model.eval()
        out = [self._token_logprobs(ids).tolist() for ids in sequences]
        self.model.reshard()  # FSDP2 keeps the root unsharded after a forward: free it
        return out

    def weight_source(self, loader: str):
        """Return what vLLM receives from this rank, in bf16 whatever the master dtype."""
        return sources.weight_source(self.model, self.world_size, loader)

    def weight_sync_client(self, sock: str, loader: str, source, trainer_gpu_uuids: list[str]):
        """Return the client rank 0 calls for each chunk: the direct loader's, or vLLM's weight routes."""
        return sources.sync_client(sock, loader, source, trainer_gpu_uuids)

    def setup_weight_transfer(
        self,
        sock: str,
        loader: str,
        packed: bool,
        packed_buffer_size_bytes: int,
        trainer_gpu_uuids: list[str],
        retries: int = 0,
    ) -> dict:
        """Build vLLM's IPC trainer engine on this rank.

        Return how many tensors the engines will copy straight from its memory (sources.InPlace), and whether its
        expert blocks are among them."""
        source = self.weight_source(loader)
        client = self.weight_sync_client(sock, loader, source, trainer_gpu_uuids)
        self.sender = helpers.weight_sender(self.rank, client, source, packed, packed_buffer_size_bytes, retries)
        names = self.sender.in_place.names if self.sender.in_place is not None else []
        return {"tensors": len(names), "experts": bool(names) and set(source.expert_blocks) <= set(names)}

    def send_weights(self, empty_cache: bool = False) -> int:
        """Send every weight, all ranks at once; return how many times the send was repeated.

        With `empty_cache`, every rank then returns the GPU memory PyTorch keeps cached (the training step's
        activations and gradients, the send's gathered modules) before any rank returns: vLLM maps back the KV cache
        it freed next, and it cannot take memory PyTorch holds, even unused."""
        return self.sender.send(empty_cache)


class RLTrainer(toy_rl.PolicyGradientStep, FSDPTrainer):
    """The trainer main() runs: FSDPTrainer with the toy policy-gradient step from proof/toy_rl.py."""


# --- The server and the job -----------------------------------------------------------------------


def serve_args(
    args: argparse.Namespace,
    gpu_ids: list[str],
    node: int = 0,
    head: tuple | None = None,
    experts: bool = True,
    context_len: int | None = None,
) -> list[str]:
    """Return helpers.serve_args for one node's GPUs, built from the flags.

    The exact check's worker extension, a subclass of the direct loader's, takes its place. `context_len` is
    the model's context length, which sets the default KV cache size."""
    return helpers.serve_args(
        args.model,
        gpu_ids,
        num_nodes=args.num_nodes,
        tensor_parallel_size=args.tensor_parallel_size,
        experts=experts,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        kv_cache_tokens=kv_cache_tokens(args, context_len),
        enforce_eager=args.enforce_eager,
        max_model_len=args.max_model_len,
        node=node,
        head=head,
        rollout_dtype=args.rollout_dtype,
        worker_extension="proof.exact_check_engine.ExactCheckWorker",
    )


def kv_cache_tokens(args: argparse.Namespace, context_len: int | None) -> int | None:
    """Return --kv-cache-tokens, by default room for two sequences of the longest context vLLM will serve.

    vLLM checks that one sequence fits, and the rollouts here are short. None lets vLLM size the cache from
    --kv-cache-memory-bytes or --gpu-memory-utilization."""
    if args.kv_cache_tokens is not None or args.kv_cache_memory_bytes is not None:
        return args.kv_cache_tokens or None
    longest = args.max_model_len or context_len
    return 2 * longest if longest else None


@dataclass
class Job:
    """What colocated_job() started."""

    trainers: list
    server: helpers.Server
    served_name: str
    dp_size: int
    architecture: str
    gpu_name: str
    gpu_uuids: list[str]
    send_retries: int = 0  # how many times a send the server failed part way is sent again
    rank_nodes: list[str] = field(default_factory=list)  # each rank's Ray node id
    weights_in_after_s: float | None = None  # seconds into the server's start when the weights were filled
    checkpoint_bytes_read_per_rank: list[int] = field(default_factory=list)  # 0 for random weights
    node_servers: list = field(default_factory=list)  # the NodeServer actors of the other nodes
    experts_in_place: bool | None = None  # whether the last setup has the engines read the trainers' experts
    tensors_in_place: int | None = None  # how many tensors the engines read from the trainers' memory, not packed


@contextmanager
def colocated_job(
    args: argparse.Namespace,
    loaders: list[str] | None = None,
    trainer_cls: type | None = None,
    proof: Proof | None = None,
):
    """Start trainer ranks with the model sharded over them, and `vllm serve` on the same GPUs.

    `trainer_cls` is any class with FSDPTrainer's methods, or such a Ray actor; RLTrainer by default. On more
    nodes, a NodeServer actor runs the server's engines on each other node. On the way out, whether through an
    error, Ctrl-C, SIGTERM or SIGHUP, stop every node's server, the trainers, and Ray if this started it.
    `proof`, if given, is told at named points: before any GPU work, with `loaders`; once the trainers are
    placed; once the job is up; and as it ends."""
    with program.hangups_unwind():  # SIGTERM and SIGHUP unwind like Ctrl-C, through every finally
        workdir = Path(tempfile.mkdtemp(prefix="rlhf-ipc-"))  # 0700, private: the server's socket goes here
        pg, started_ray, node_servers, job = None, not ray.is_initialized(), [], None
        try:
            model_path = models.resolve_model(args.model, workdir)
            if proof:
                proof.before_gpu_work(model_path, loaders or [args.weight_loader])
            # The servers' workers import the direct loader and the exact check from this directory.
            env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
            # Given at the server's start, before its PyTorch reads its allocator's settings; the other nodes' too.
            env.update(vllm_adapter.serve_env(args.rollout_dtype))
            # vLLM imports itself, a third of its start, while Ray starts and places the trainers and they build
            # their models; it touches no GPU until serve() gives it its flags, the GPUs Ray gave them among them.
            with helpers.serving(None, socket_path=workdir / "vllm.sock", log_path=args.server_log, env=env) as server:
                try:
                    if started_ray:
                        program.init_ray()
                    print(
                        f"[trainers] reserving {args.num_gpus} GPUs on {args.num_nodes} node(s) through Ray", flush=True
                    )
                    trainers, pg = start_trainers(
                        trainer_cls or RLTrainer,
                        args.num_gpus,
                        args.num_nodes,
                        placement_timeout_s=args.placement_timeout,
                        rendezvous=TCPRendezvous,  # used only on more than one node
                    )
                    if started_ray:  # Stop a local Ray we started even if we are SIGKILLed: its agents would linger.
                        server.also_stop(program.descendants(os.getpid(), os.path.dirname(ray.__file__)))
                    ranks = placements(trainers)
                    if proof:
                        proof.trainers_placed(ranks)
                    filling = build_models(trainers, args, model_path)
                    flags = serve_plan(args, ranks, model_path)
                    network = gloo_interface_env(ranks[0]["node_ip"]) if args.num_nodes > 1 else {}
                    node_model = args.model if args.model in models.PRESETS else str(model_path)  # a preset or path
                    node_servers = start_node_servers(
                        pg, node_model, args.server_log, env, flags[1:], resolve_model=models.resolve_model
                    )
                    print(
                        f"[trainers] model sharded over {args.num_gpus} ranks; starting vllm serve: {args.server_log}"
                    )
                    server.serve([str(model_path), *flags[0]], env=network)
                    weights_in_after_s = wait_until_ready(
                        server, filling, args.server_timeout, also_check=partial(raise_node_failure, node_servers)
                    )
                    job = Job(
                        trainers=trainers,
                        server=server,
                        served_name=args.model,
                        dp_size=args.num_gpus // args.tensor_parallel_size,
                        architecture=models.architecture(model_path),
                        gpu_name=ranks[0]["gpu_name"],
                        gpu_uuids=[p["gpu_uuid"] for p in ranks],
                        rank_nodes=[p["node"] for p in ranks],
                        weights_in_after_s=weights_in_after_s,
                        checkpoint_bytes_read_per_rank=ray_get_all(filling),
                        node_servers=node_servers,
                    )
                    if proof:
                        proof.job_started(job)
                    yield job
                except helpers.ServerError as e:  # name the node whose server died, if one did
                    raise_node_failure(node_servers, seen_as=e)
                    raise
                finally:  # leave Ray first, while the server's watchdog still covers a SIGKILL
                    with helpers.signals_ignored():
                        if proof and job is not None:
                            proof.job_ending()
                        node_servers = stop_node_servers(node_servers)
                        pg = leave_ray(started_ray, pg)
        finally:
            with helpers.signals_ignored():
                stop_node_servers(node_servers)
                leave_ray(started_ray, pg)
                shutil.rmtree(workdir, ignore_errors=True)


def serve_plan(args: argparse.Namespace, placements: list[dict], model_path: Path) -> list[list[str]]:
    """Return serve_args() for each node, on the GPUs of its trainer ranks, which Ray placed in node order.

    Node 0 serves the API and the DP handshake on its own address."""
    per_node = args.num_gpus // args.num_nodes
    gpus = [[p["gpu_ids"][0] for p in placements[k : k + per_node]] for k in range(0, args.num_gpus, per_node)]
    head = (placements[0]["node_ip"], free_port(placements[0]["node_ip"])) if args.num_nodes > 1 else None
    experts, context_len = models.has_experts(model_path), models.context_length(model_path)
    return [serve_args(args, node_gpus, k, head, experts, context_len) for k, node_gpus in enumerate(gpus)]


def build_models(trainers: list, args: argparse.Namespace, model_path: Path) -> list:
    """Allocate every rank's shard of the model, then start filling it; return the refs to wait on.

    Allocation comes first: a starting vLLM needs its share of each GPU free, and sizes its KV cache assuming
    no other process's memory changes. Filling, which runs while the server starts, takes no more memory."""
    ray_get_all([t.build_model.remote(str(model_path), args.lr if args.train else None) for t in trainers])
    return [t.init_weights.remote(str(model_path), args.model in models.PRESETS, args.seed) for t in trainers]


# --- The RL round ---------------------------------------------------------------------------------


def choose_loader_on_the_engines(job: Job, args: argparse.Namespace) -> None:
    """Make parse_args' loader choice again with the server's own vLLM, which may differ from this interpreter's.

    Every engine checks what the direct loader needs (sources.engines_lack). If one lacks something, a run left
    to the default syncs through vLLM's own loader, saying so in the line parse_args prints for this vLLM; a
    run that asked for the direct loader stops with that line."""
    if args.weight_loader != "direct":
        return
    lacks = sources.engines_lack(job.server.socket_path, DIRECT_LOADER, args.rollout_dtype)
    if lacks is None:
        return
    where, line = lacks
    asked = "direct" if args.weight_loader_reason == "asked for" else None
    args.weight_loader, args.weight_loader_reason = loader_choice(asked, missing=lambda _: [line], where=where)
    print(f"[sync] {args.weight_loader_reason}", flush=True)


def setup_weight_transfer_on_every_rank(
    job: Job, args: argparse.Namespace, loader: str, proof: Proof | None = None
) -> None:
    """Build vLLM's IPC trainer engine for `loader` on every rank, then tell `proof`, if given, to watch the sends."""
    sock = job.server.socket_path
    # Only the direct loader's sends are retried: after a failed chunk, vLLM's own route leaves
    # its layer-wise reload half done, and a second send would load on top of it.
    job.send_retries = args.send_retries if loader == "direct" else 0
    in_place = ray_get_all(
        [
            t.setup_weight_transfer.remote(
                sock, loader, args.packed, args.packed_buffer_size_bytes, job.gpu_uuids, job.send_retries
            )
            for t in job.trainers
        ]
    )
    job.experts_in_place = all(r["experts"] for r in in_place)
    job.tensors_in_place = min((r["tensors"] for r in in_place), default=0)
    if loader == "direct":
        how = "each engine copies them from the trainer rank's memory" if job.experts_in_place else "packed, in bf16"
        print(f"[sync] expert blocks: {how}; {job.tensors_in_place} tensors in all go in place", flush=True)
    if proof:
        proof.transfer_ready(job, args)


def run_round(job: Job, args: argparse.Namespace, proof: RoundProof) -> None:
    """Run one round: generate, sleep, train if asked, wake the weights, send, and wake the KV cache.

    `proof` times each step and scores the batch; Proof.round judges the sync once the round is through."""
    sock, trainers = job.server.socket_path, job.trainers
    # 1. Generate: one greedy completion per prompt, or several samples to train on.
    prompts = args.prompts * (args.samples_per_prompt if args.train else 1)
    temperature = args.temperature if args.train else 0.0
    batch = generation.completions(sock, job.served_name, prompts, args.max_tokens, temperature)
    proof.generated(batch)
    samples, reward_mean = toy_rl.policy_gradient_samples(batch) if args.train else ([], None)
    # 2-6. The sync, with the training step while vLLM's memory is free.
    with proof.step("sleep"):
        kv_cache_freed = helpers.sleep_for_sync(sock, args.sleep_level, frees_kv_cache(args))
    loss = None
    if samples:
        with proof.step("train"):
            loss = ray_get_all([t.train_step.remote(samples) for t in trainers])[0]
    if args.train:
        proof.trained(reward_mean, loss)
    with proof.step("wake_weights"):
        helpers.wake_weights(sock, args.sleep_level)
    with proof.step("send"):  # and if the KV cache was freed, every rank empties PyTorch's cache
        _, proof.send_retries = send_all(
            trainers, kv_cache_freed, check_failure=partial(raise_node_failure, job.node_servers)
        )
    with proof.step("wake_kv"):
        helpers.wake_to_serve(sock, kv_cache=kv_cache_freed)


def frees_kv_cache(args: argparse.Namespace) -> bool:
    """Return whether the sync frees the KV cache at sleep level 0: --free-kv-cache, by default only with --train."""
    return args.train if args.free_kv_cache is None else args.free_kv_cache


def more_rounds(args: argparse.Namespace, done: int, seconds_since_first: float) -> bool:
    """Return whether to run another round: --rounds of them, then more until --soak-seconds have passed."""
    return done < args.rounds or seconds_since_first < args.soak_seconds


def round_numbers(args: argparse.Namespace) -> Iterator[int]:
    """Yield the round numbers 1, 2, ... while more_rounds() allows, printing each one."""
    first_round_at, done = time.monotonic(), 0
    while more_rounds(args, done, time.monotonic() - first_round_at):
        done += 1
        soak = f" ({time.monotonic() - first_round_at:.0f} of {args.soak_seconds:.0f} s)"
        print(f"=== round {done}/{args.rounds}{soak if args.soak_seconds else ''} ===", flush=True)
        yield done


def generate(job: Job, args: argparse.Namespace, label: str) -> list[generation.Completion]:
    """One greedy completion per prompt, printed under `label`."""
    batch = generation.completions(job.server.socket_path, job.served_name, args.prompts, args.max_tokens)
    print(f"--- {label} ---", *(f"{p!r} -> {c.text!r}" for p, c in zip(args.prompts, batch, strict=True)), sep="\n")
    return batch


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    proof = Proof(args, started)  # the checks and measurements, from outside every step below
    with colocated_job(args, proof=proof) as job:
        choose_loader_on_the_engines(job, args)  # the server's vLLM may lack what this interpreter's has
        setup_weight_transfer_on_every_rank(job, args, args.weight_loader, proof)
        greedy = generate(job, args, "before the first sync")
        proof.before_rounds(greedy)  # the gate's basis: the trainer's own kernel noise on these tokens
        for i in round_numbers(args):
            with proof.round(i) as round_proof:  # 7. once the round is through: the exact check and the gate
                run_round(job, args, round_proof)
        generate(job, args, "after the last sync")
    return proof.report()


if __name__ == "__main__":
    program.cli(main)
