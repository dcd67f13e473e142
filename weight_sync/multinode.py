# SPDX-License-Identifier: Apache-2.0
"""Run the trainers and one vLLM server across several nodes of a Ray cluster.

Copy this module beside helpers.py, and beside weight_sync/direct_load.py for the direct loader, when the job
spans several nodes; one node does not need it.

One vLLM server spans the nodes through vLLM's multi-node data parallelism. Node 0, where the driver runs,
serves the API and runs its engines. Every other node runs its engines alone with `vllm serve --headless`,
started and owned by a NodeServer actor in that node's bundle of the trainers' placement group. Each engine
still reads the CUDA IPC buffer of the trainer rank on its own GPU. When a server exits on any node,
raise_node_failure names it through ray_trainers' checks: wait_until_ready's `also_check` and send_all's
`check_failure`.

On the driver, with helpers' and ray_trainers' names; start_trainers handles the nodes, and its ranks meet through TCPRendezvous:

    trainers, pg = start_trainers(MyTrainer, num_gpus, num_nodes, trainer_args=(...), rendezvous=TCPRendezvous)
    ranks = placements(trainers)                                   # in node order, rank 0 on this node
    head = (ranks[0]["node_ip"], free_port(ranks[0]["node_ip"]))   # node 0's DP handshake
    flags = [serve_args(model_name, node_gpu_ids[k], num_nodes=num_nodes, node=k, head=head)
             for k in range(num_nodes)]                            # node_gpu_ids[k]: the GPU ids of node k's ranks
    node_servers = start_node_servers(pg, model_dir, "vllm-server.log", env, flags[1:])   # nodes 1, 2, ...
    try:
        with serving([model_dir, *flags[0]], socket_path=private_dir / "vllm.sock", log_path="vllm-server.log",
                     env={**env, **gloo_interface_env(ranks[0]["node_ip"])}) as server:
            node_failure = partial(raise_node_failure, node_servers)   # raises NodeServerFailed, naming the nodes
            wait_until_ready(server, filling, timeout_s=1200, also_check=node_failure)   # filling: refs, or []
            ...                                                     # each round as on one node, with
            send_all(trainers, check_failure=node_failure)
    finally:
        stop_node_servers(node_servers)

The public names are start_node_servers with its NodeServer actors, stop_node_servers, raise_node_failure with
NodeServerFailed, free_port, job_env, which carries the driver's settings to every node through ray.init, and
gloo_interface_env. TCPRendezvous, built on open_tcp_rendezvous and join_tcp_rendezvous, lets the trainers meet
across nodes. The model must be at the same path on every node, unless each node builds it with resolve_model.
Run the job on a network you trust: vLLM's and the trainers' handshakes listen on the cluster network.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from pathlib import Path

import ray
import torch.distributed as dist

from helpers import DEFAULT_LAUNCHER, ServerError, log_tail, start_server, stop_server
from weight_sync.ray_trainers import death_cause, ray_get_all

_listener = None  # rank 0's: the TCP socket its store listens on


def open_tcp_rendezvous(host: str, world_size: int, timeout) -> tuple:
    """On rank 0, open a TCPStore bound to rank 0's address `host` only; return the store and its port.

    torch's own TCPStore listens on every interface. Neither has authentication, so the job needs a network you
    trust. ray_trainers.open_rendezvous calls this for trainers on several nodes."""
    global _listener
    _listener = socket.create_server((host, 0))
    port = _listener.getsockname()[1]
    store = dist.TCPStore(
        host,
        port,
        world_size,
        is_master=True,
        master_listen_fd=_listener.fileno(),
        wait_for_workers=False,
        timeout=timeout,
    )
    return store, port


def join_tcp_rendezvous(rank: int, host: str, port: int, world_size: int, rank0_store, timeout):
    """Return the store a rank joins the process group at: rank 0's own, or a client of it at `host`:`port`.

    It also points gloo at the interface of this node's cluster address, which the other nodes reach.
    ray_trainers.join_process_group calls this."""
    os.environ.update(gloo_interface_env(ray.util.get_node_ip_address()))
    if rank == 0:
        return rank0_store
    return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)


class TCPRendezvous:
    """How trainer ranks on several nodes meet; pass it as ray_trainers.start_trainers(..., rendezvous=TCPRendezvous).

    start_trainers runs `open` on rank 0 and `join` on every rank. helpers imports nothing of this project, so it
    is handed this class."""

    open = staticmethod(open_tcp_rendezvous)
    join = staticmethod(join_tcp_rendezvous)


def gloo_interface_env(node_ip: str) -> dict[str, str]:
    """Return GLOO_SOCKET_IFNAME for the network interface that holds this node's cluster address.

    A process that talks gloo to other nodes needs it. Without it, gloo binds the address the host's name
    resolves to, 127.0.1.1 on many distributions, which no other node reaches. A value the user set wins."""
    import psutil  # a Ray dependency

    if "GLOO_SOCKET_IFNAME" in os.environ:
        return {}
    names = [name for name, addrs in psutil.net_if_addrs().items() if any(a.address == node_ip for a in addrs)]
    return {"GLOO_SOCKET_IFNAME": names[0]} if names else {}


class NodeServer:
    """A Ray actor that owns one node's headless `vllm serve`, which runs the DP engines of that node's GPUs.

    The API server runs on the first node. The actor lives in its node's bundle of the placement group, so Ray
    starts it there and stops it with the driver. The server's watchdog stops the server once this actor's
    process is gone, however it ended."""

    def __init__(self, node_index: int) -> None:
        self.node_index, self.server = node_index, None
        self.workdir = Path(tempfile.mkdtemp(prefix="rlhf-ipc-node-"))  # 0700, private like the first node's

    def start(
        self,
        model: str,
        serve_flags: list[str],
        log_path: str,
        env: dict,
        launcher=DEFAULT_LAUNCHER,
        resolve_model=None,
    ) -> str:
        """Start `vllm serve <model's local path> <serve_flags>` and return where this node is, for messages.

        `model` is the directory the driver resolved, which must be at that path on this node too, or what
        `resolve_model(model, a private directory)` turns into one here."""
        try:
            model_path = resolve_model(model, self.workdir) if resolve_model else Path(model)
        except SystemExit as e:  # resolve_model's one-line error, naming this node
            raise ServerError(f"{self.where()}: {e}") from None
        env = {**env, **gloo_interface_env(ray.util.get_node_ip_address())}  # this node's, not the driver's
        self.server = start_server(
            [str(model_path), *serve_flags],
            socket_path=self.workdir / "vllm.sock",
            log_path=log_path,
            env=env,
            launcher=launcher,
        )
        return self.where()

    def pgid(self) -> int:
        """Return the process group of this node's server, to tell its GPU memory from others'."""
        return self.server.pgid

    def where(self) -> str:
        ray_node = ray.get_runtime_context().get_node_id()[:8]
        return f"node {self.node_index} ({ray.util.get_node_ip_address()}, Ray node {ray_node})"

    def failure(self) -> str | None:
        """Return None while the server runs, else how it ended, with the end of its log."""
        if self.server is None or (code := self.server.proc.poll()) is None:
            return None
        return (
            f"the vLLM server on {self.where()} exited with code {code}; last lines of "
            f"{self.server.log_path}:\n{log_tail(self.server, 15)}"
        )

    def stop(self) -> None:
        if self.server is not None:
            stop_server(self.server)
        shutil.rmtree(self.workdir, ignore_errors=True)


def free_port(host: str) -> int:
    """Return a TCP port free on `host` now, for vLLM's DP handshake, which binds it itself."""
    # vLLM's get_open_port takes no host: it binds every interface, or tries ports upward from VLLM_PORT.
    # The handshake binds node 0's cluster address, so that is the address to ask.
    with socket.create_server((host, 0)) as s:
        return s.getsockname()[1]


def start_node_servers(
    pg,
    model: str,
    log_path: str,
    env: dict,
    flags_per_node: list[list[str]],
    launcher=DEFAULT_LAUNCHER,
    resolve_model=None,
) -> list:
    """Start `vllm serve <model> <flags>` on nodes 1, 2, ... of `pg`, each under a NodeServer actor; return them.

    Each server is already starting when this returns. Its log goes to `log_path` made absolute, with `.node<k>`
    before the suffix, on that node's disk. `model` is the model's directory as the driver resolved it, absolute
    and at the same path on every node, or what each node makes a directory of with `resolve_model(model, a
    private directory)`. The script's presets take the second way: the driver's directory is private, so each
    node builds its own. Do not pass the model as the user gave it: a relative path would resolve against each
    actor's working directory, and a Hugging Face id would be downloaded again on every node."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    actor, log = ray.remote(NodeServer), Path(log_path).absolute()  # a Ray worker's cwd is not ours
    servers = [
        actor.options(
            num_cpus=0, scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=k)
        ).remote(k)
        for k in range(1, len(flags_per_node) + 1)
    ]
    try:
        ray_get_all(
            [
                server.start.remote(
                    model, flags, str(log.with_suffix(f".node{k}{log.suffix}")), env, launcher, resolve_model
                )
                for k, (server, flags) in enumerate(zip(servers, flags_per_node, strict=True), start=1)
            ],
            who="the Ray actor of a node's vLLM server",
        )
    except BaseException:
        stop_node_servers(servers)  # those that did start
        raise
    return servers


class NodeServerFailed(ServerError):
    """The vLLM server of a node other than the first exited, or its NodeServer actor is lost."""


def raise_node_failure(node_servers: list, seen_as: Exception | None = None) -> None:
    """Raise NodeServerFailed naming every node whose server exited or whose actor is lost or silent; else return.

    `seen_as` is the error that made us look. It is raised as it is if an earlier look already named the nodes."""
    if isinstance(seen_as, NodeServerFailed):
        raise seen_as
    asked = [server.failure.remote() for server in node_servers]
    answered = set(ray.wait(asked, num_returns=len(asked), timeout=60)[0])  # 60 s for all of them together
    failures = []
    for k, ref in enumerate(asked, start=1):
        try:
            failures.append(
                ray.get(ref) if ref in answered else f"the Ray actor of node {k}'s vLLM server does not answer (60 s)"
            )
        except ray.exceptions.RayActorError as e:
            failures.append(f"the Ray actor of node {k}'s vLLM server is lost: {death_cause(e)}")
    if failures := [f for f in failures if f]:
        raise NodeServerFailed("\n".join(failures) + (f"\n(seen here as: {seen_as})" if seen_as else "")) from None


def stop_node_servers(node_servers: list) -> list:
    """Stop every node's server, wait until its processes are gone, and return [], as nothing is left to stop.

    A server that cannot be stopped this way, because its node or actor is lost, is stopped by its watchdog."""
    stops = [server.stop.remote() for server in node_servers]
    for k, stop in enumerate(stops, start=1):
        try:
            ray.get(stop, timeout=60)
        except Exception as e:  # keep going: the other nodes' servers still need stopping
            print(f"[shutdown] node {k}'s vLLM server: {death_cause(e)}", flush=True)
    return []


def job_env() -> dict[str, str]:
    """Return the driver's settings for vLLM, NCCL, gloo, Hugging Face and torch, for ray.init(runtime_env=...).

    Ray's workers get the environment of the Ray node they run on, not the driver's, so a `NCCL_SOCKET_IFNAME` or
    `HF_HUB_OFFLINE` exported where the script runs would not reach the other nodes' trainers and servers.
    VLLM_HOST_IP is left out, since it is each node's own address. So are secrets such as `HF_TOKEN` and
    `VLLM_API_KEY`, since Ray shows a job's runtime env in its dashboard and job list. Interface names set here,
    such as `NCCL_SOCKET_IFNAME` and `GLOO_SOCKET_IFNAME`, hold on every node."""
    prefixes, secret = ("VLLM_", "NCCL_", "GLOO_", "HF_", "TORCH_", "PYTORCH_"), ("TOKEN", "KEY", "SECRET", "PASSWORD")
    return {
        k: v
        for k, v in os.environ.items()
        if k.startswith(prefixes) and k != "VLLM_HOST_IP" and not any(s in k for s in secret)
    }
