"""Placing, calling and stopping what rlhf_ipc_fsdp_ep.py runs on the Ray cluster.

Every rank of the trainer takes part in collectives, so a call is made on all
of them at once and must not wait on a rank that is gone:

  Rank              a trainer rank's side: its GPU, the process group it joins
  start_trainers    one trainer rank per GPU, on whole nodes, rank 0 on this one
  ray_get_all       every rank's result, failing at the first error (a dead
                    rank as TrainerDied, naming why; a server error as itself)
  send_all          one weight sync on every rank, sent again when the server
                    failed it part way (--send-retries), unless a node's server is gone
  NodeServer        an actor that owns the headless `vllm serve` of another node
  wait_until_ready  the trainers' weights filled, every node's server healthy
  init_ray          ray.init() with the driver's settings on every node (job_env),
                    SIGTERM still unwinding
  leave_ray         Ray left as we found it (the trainers' rendezvous directory too)
  cli               a program's failures as one `error:` line, not a traceback
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import ray
import torch
import torch.distributed as dist

import helpers


COLLECTIVE_TIMEOUT = timedelta(minutes=10)  # longer than any server call (helpers.SERVER_CALL_TIMEOUT_S)


class PlacementError(RuntimeError):
    """Ray cannot give every trainer rank its GPU on the nodes asked for."""


class TrainerDied(RuntimeError):
    """A trainer rank's process died (killed, out of memory, crashed)."""


class Rank:
    """One rank of a torch.distributed job on one GPU, as a Ray actor: what
    start_trainers asks of the class it starts (a trainer derives from it)."""

    def __init__(self, rank: int, world_size: int, device_type: str = "cuda"):
        self.rank, self.world_size = rank, world_size
        self.device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # Ray made this rank's GPU the only visible one

    def open_rendezvous(self, host: str) -> str | int:
        """Rank 0: open the store where the ranks meet; returns where the
        others find it (for join_process_group).

        One node (`host` 127.0.0.1): a torch FileStore, a file in a directory
        of its own that tempfile.mkdtemp creates with mode 0700, so no other
        user can read or write it, and nothing listens on a port that any
        local user could connect to. Returns the file's path. Every rank
        opens it, so the directory must stay while they run; it goes with
        them (leave_ray, or remove_rendezvous).

        More nodes (`host` rank 0's address, which the other nodes reach): a
        TCPStore on a port the kernel picks; returns the port. Torch lets us
        choose only where it listens, not who connects: it has no
        authentication or encryption, so anyone who reaches that address can
        read and write its keys. We bind the socket ourselves, on that one
        address (torch's TCPStore alone listens on every interface); the job
        needs a network you trust, as any multi-node torch.distributed job
        does. (A port picked earlier and closed could be taken meanwhile.)"""
        if host == "127.0.0.1":
            self._rendezvous_dir = Path(tempfile.mkdtemp(prefix="rlhf-ipc-rendezvous-"))
            atexit.register(shutil.rmtree, self._rendezvous_dir, ignore_errors=True)  # if this rank ends normally
            path = self._rendezvous_dir / "store"
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))  # ours, before torch opens it
            self._store = file_store(path, self.world_size)
            return str(path)
        self._listener = socket.create_server((host, 0))
        port = self._listener.getsockname()[1]
        self._store = dist.TCPStore(host, port, self.world_size, is_master=True,
                                    master_listen_fd=self._listener.fileno(), wait_for_workers=False,
                                    timeout=COLLECTIVE_TIMEOUT)  # fmt: skip
        return port

    def join_process_group(self, host: str, where: str | int) -> None:
        """Join the process group at what rank 0's open_rendezvous returned:
        the store's file (one node) or its port on `host`."""
        if self.rank == 0:
            store = self._store
        elif isinstance(where, str):
            store = file_store(where, self.world_size)
        else:
            store = dist.TCPStore(host, where, self.world_size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
        if host != "127.0.0.1":  # more than one node: gloo on the interface the other nodes reach
            os.environ.update(gloo_interface_env(ray.util.get_node_ip_address()))
        # CUDA tensors (FSDP2) go over NCCL, the rest over gloo: vLLM's IPC engine syncs every chunk with
        # all_gather_object + barrier on this group, which then wait on the host instead of spinning an
        # NCCL kernel on the GPU that the colocated engine is copying on. (No device_id: it would bind
        # the barrier to NCCL.)
        dist.init_process_group("cpu:gloo,cuda:nccl" if self.device.type == "cuda" else "gloo", store=store,
                                rank=self.rank, world_size=self.world_size, timeout=COLLECTIVE_TIMEOUT)  # fmt: skip

    def placement(self) -> dict:
        """Which GPU, on which node, Ray gave this rank."""
        info = {"rank": self.rank, "pid": os.getpid(), "gpu_ids": [str(i) for i in ray.get_gpu_ids()],
                "node": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address()}  # fmt: skip
        if self.device.type == "cuda":
            props = torch.cuda.get_device_properties(self.device)
            info.update(gpu_name=props.name, gpu_uuid=str(props.uuid))
        return info


def file_store(path: str | os.PathLike, world_size: int) -> dist.FileStore:
    """Torch's FileStore at `path` for `world_size` ranks, with the collectives' timeout.
    (It opens the file again for every operation: its directory must outlive the ranks.)"""
    store = dist.FileStore(str(path), world_size)
    store.set_timeout(COLLECTIVE_TIMEOUT)
    return store


_rendezvous_dirs: dict[str, Path] = {}  # placement group id -> its trainers' one-node store's directory


def remove_rendezvous(pg) -> None:
    """Remove the directory of the one-node store that `pg`'s trainers met
    at (call it when they are gone, or going: they open it on every use)."""
    if (where := _rendezvous_dirs.pop(pg.id.hex(), None)) is not None:
        shutil.rmtree(where, ignore_errors=True)


@atexit.register
def _remove_rendezvous_left() -> None:
    """At this process's exit, what remove_rendezvous was not called for:
    Ray stops a job's trainers with its driver."""
    for where in _rendezvous_dirs.values():
        shutil.rmtree(where, ignore_errors=True)


def start_trainers(trainer_cls: type, num_trainers: int, num_nodes: int = 1, gpus_per_trainer: float = 1,
                   device_type: str = "cuda", placement_timeout_s: float = 60) -> tuple[list, object]:  # fmt: skip
    """Reserve one GPU per trainer rank, the same number on each of
    `num_nodes` nodes, the first of them this one (where vLLM's API server
    and trainer rank 0 run); start the ranks in node order and join them in one
    process group. Returns (trainers, placement group). Raises PlacementError
    if Ray cannot place them in time."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    have = ray.cluster_resources().get("GPU", 0)
    if gpus_per_trainer and have < num_trainers * gpus_per_trainer:
        raise PlacementError(f"asked for {num_trainers} GPUs but the Ray cluster has {have:g}")
    per_node = num_trainers // num_nodes
    here = ray.get_runtime_context().get_node_id()
    here_gpus = next(n["Resources"].get("GPU", 0) for n in ray.nodes() if n["NodeID"] == here)
    if here_gpus < per_node * gpus_per_trainer:
        raise PlacementError(f"this node has {here_gpus:g} GPUs in Ray, and needs {per_node * gpus_per_trainer:g}: "
                             "run the script on a GPU node (it runs vLLM's API server and trainer rank 0)")  # fmt: skip
    # One bundle per node. CUDA IPC only works between processes on one machine, so every
    # trainer rank shares its node with the engine on its GPU: STRICT_PACK puts one node's
    # ranks together, STRICT_SPREAD the nodes apart; the first node is this one.
    bundle = {"CPU": per_node, **({"GPU": per_node * gpus_per_trainer} if gpus_per_trainer else {})}
    pg = placement_group([bundle] * num_nodes, strategy="STRICT_SPREAD" if num_nodes > 1 else "STRICT_PACK",
                         bundle_label_selector=[{"ray.io/node-id": here}] + [{}] * (num_nodes - 1))  # fmt: skip
    if not pg.wait(timeout_seconds=placement_timeout_s):
        ray.util.remove_placement_group(pg)
        raise PlacementError(
            f"Ray could not place {num_trainers} trainers on {num_nodes} node(s) ({bundle} on each, the first "
            f"one this node) within {placement_timeout_s:.0f}s; cluster resources: {ray.cluster_resources()}"
        )
    # A class, or one that is a Ray actor already (@ray.remote): either way a Rank's methods.
    actor = trainer_cls if isinstance(trainer_cls, ray.actor.ActorClass) else ray.remote(trainer_cls)
    try:
        trainers = [
            actor.options(num_cpus=1, num_gpus=gpus_per_trainer, scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=r // per_node)).remote(r, num_trainers, device_type)
            for r in range(num_trainers)
        ]  # fmt: skip
        # One node: rendezvous on loopback. More: on rank 0's address, which the other nodes reach.
        host = "127.0.0.1" if num_nodes == 1 else ray.util.get_node_ip_address()
        where = ray_get_all([trainers[0].open_rendezvous.remote(host)])[0]
        if isinstance(where, str):  # one node, this one: the store's file, in a directory of its own
            _rendezvous_dirs[pg.id.hex()] = Path(where).parent
        ray_get_all([t.join_process_group.remote(host, where) for t in trainers])
    except BaseException:  # a rank that did not start, or Ctrl-C: the caller never gets the group to remove
        ray.util.remove_placement_group(pg)  # and its trainers with it
        remove_rendezvous(pg)
        raise
    return trainers, pg


def init_ray() -> None:
    """ray.init() for the job: a running cluster if there is one (RAY_ADDRESS,
    `ray start`), else a local Ray; every node's processes get the driver's
    settings (job_env). Then SIGTERM and SIGHUP unwind again
    (helpers.unwind_on_hangups): Ray's own handler would abort the cleanup."""
    ray.init(include_dashboard=False, runtime_env={"env_vars": job_env()})
    helpers.unwind_on_hangups()


def job_env() -> dict[str, str]:
    """The driver's settings for vLLM, NCCL, gloo, Hugging Face and torch, for
    ray.init(runtime_env=...): Ray's workers get the environment of the Ray
    node they run on, not the driver's, so a `NCCL_SOCKET_IFNAME` or
    `HF_HUB_OFFLINE` exported where the script runs would not reach the other
    nodes' trainers and servers. Not VLLM_HOST_IP (each node's own address),
    nor secrets (`HF_TOKEN`, `VLLM_API_KEY`: Ray keeps a job's runtime env
    where its dashboard and job list show it). Interface names
    (`NCCL_SOCKET_IFNAME`, `GLOO_SOCKET_IFNAME`) set here hold on every node."""
    prefixes, secret = ("VLLM_", "NCCL_", "GLOO_", "HF_", "TORCH_", "PYTORCH_"), ("TOKEN", "KEY", "SECRET", "PASSWORD")
    return {k: v for k, v in os.environ.items()
            if k.startswith(prefixes) and k != "VLLM_HOST_IP" and not any(s in k for s in secret)}  # fmt: skip


def gloo_interface_env(node_ip: str) -> dict[str, str]:
    """GLOO_SOCKET_IFNAME for a process that talks gloo to other nodes: the
    network interface that holds this node's cluster address. Without it,
    gloo binds the address the host's name resolves to, on many
    distributions 127.0.1.1, which no other node reaches. A value the user
    set wins."""
    import psutil  # a Ray dependency

    if "GLOO_SOCKET_IFNAME" in os.environ:
        return {}
    names = [name for name, addrs in psutil.net_if_addrs().items() if any(a.address == node_ip for a in addrs)]
    return {"GLOO_SOCKET_IFNAME": names[0]} if names else {}


def leave_ray(started_ray: bool, pg) -> None:
    """Leave Ray as we found it: shut down if we started it (again is a no-op),
    else our placement group removed, and the trainers with it; and their
    one-node rendezvous directory."""
    if started_ray:
        ray.shutdown()
    elif pg is not None:
        ray.util.remove_placement_group(pg)
    if pg is not None:
        remove_rendezvous(pg)


def ray_get_all(refs: list, who: str = "a trainer rank", also_check=None):
    """ray.get(refs), but raise as soon as any one fails: the others may be
    blocked in a collective waiting for it. A ServerError (the server
    refused or died) is raised as itself, prefixed by `who` raised it; a dead
    actor (`who`'s process) as TrainerDied. `also_check()`, if given, runs
    every 2 s while they run, and may raise to stop the wait."""
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=None if also_check is None else 2)
        if not done:
            also_check()
            continue
        try:
            ray.get(done[0])
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, helpers.ServerError):
                raise helpers.ServerError(f"{who}: {e.cause}") from None
            raise
        except ray.exceptions.RayActorError as e:
            raise TrainerDied(f"{who}'s process died: {death_cause(e)}") from e
    return ray.get(refs)


def death_cause(error: Exception) -> str:
    """The first line of Ray's report, and the error that killed the actor if
    it names one (e.g. CUDA out of memory in the constructor)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    cause = [line for line in lines if line.split(":")[0].endswith(("Error", "Exception"))]
    return lines[0] + (f" ... {cause[-1]}" if cause and cause[-1] != lines[0] else "")


def send_all(trainers: list, sock: str, retries: int = 0, node_servers: list = ()) -> tuple[list, int]:
    """send_weights() on every rank; returns what each rank reports and how
    many times the send was retried. A send the server failed part way (an
    HTTP error, a refused chunk, a timeout) is sent again from the start, up to
    `retries` times: vLLM is still asleep, and every weight is re-sent. A dead
    rank (TrainerDied) or a dead server is not retried: the first node's
    server must answer, and every other node's (`node_servers`, from
    start_node_servers) must still run; one that does not is named at the
    first failed send, as raise_node_failure names it."""
    first = why = None
    for attempt in range(retries + 1):
        sends = [t.send_weights.remote() for t in trainers]
        try:
            return ray_get_all(sends, also_check=_answering(sock)), attempt
        except helpers.ServerError as e:
            first = first or e
            raise_node_failure(node_servers, seen_as=helpers.ServerError(
                f"the send failed part way (not retried); vLLM holds a mix of old and new weights: {e}"))  # fmt: skip
            if attempt == retries:
                why = None if retries else "not retried"  # --send-retries 0, or vLLM's own loader (send_retries)
                break
            if not helpers.health(sock):
                why = "not retried: the server does not answer"
                break
            if len(ray.wait(sends, num_returns=len(sends), timeout=60)[0]) < len(sends):
                why = "not retried: a trainer rank is still in the send"
                break
            print(f"[send] {e}\n[send] vLLM is still asleep: sending every weight again "
                  f"(retry {attempt + 1} of {retries})", flush=True)  # fmt: skip
    detail = why or (f"{attempt + 1} tries" if attempt else "")
    raise helpers.ServerError(f"the send failed part way{f' ({detail})' if detail else ''}; "
                              f"vLLM holds a mix of old and new weights: {first}")  # fmt: skip


def _answering(sock: str):
    """A check for ray_get_all that raises once the server has failed GET
    /health twice in a row. A server whose engine died keeps its API server
    up while it waits for open requests, such as the chunk in flight, which
    then never return (until helpers.SERVER_CALL_TIMEOUT_S)."""
    misses = [0]

    def check() -> None:
        misses[0] = 0 if helpers.health(sock) else misses[0] + 1
        if misses[0] >= 2:
            raise helpers.ServerError("the vLLM server stopped answering GET /health during the send (its engine died?)")

    return check


class NodeServer:
    """A Ray actor that owns one node's headless `vllm serve` (the DP engines
    of that node's GPUs; the API server runs on the first node). It lives in
    the placement group's bundle of its node, so Ray starts it there and stops
    it with the driver; and the server's watchdog stops the server when this
    actor's process is gone, however it ended."""

    def __init__(self, node_index: int) -> None:
        self.node_index, self.server = node_index, None
        self.workdir = Path(tempfile.mkdtemp(prefix="rlhf-ipc-node-"))  # private (0700), like the first node's

    def start(self, model: str, serve_flags: list[str], log_path: str, env: dict,
              launcher=helpers.DEFAULT_LAUNCHER) -> str:  # fmt: skip
        """Start `vllm serve <model's local path> <serve_flags>`; returns where
        this node is, for messages. `model`: the directory the driver
        resolved (it must be at that path on this node too), or a preset's
        name, built on this node."""
        import models

        try:
            model_path = models.resolve_model(model, self.workdir)
        except SystemExit as e:  # its one-line error, for this node
            raise helpers.ServerError(f"{self.where()}: {e}") from None
        env = {**env, **gloo_interface_env(ray.util.get_node_ip_address())}  # this node's, not the driver's
        self.server = helpers.start_server([str(model_path), *serve_flags], socket_path=self.workdir / "vllm.sock",
                                           log_path=log_path, env=env, launcher=launcher)  # fmt: skip
        return self.where()

    def pgid(self) -> int:
        """The process group of this node's server (to tell its GPU memory from others')."""
        return self.server.pgid

    def where(self) -> str:
        return f"node {self.node_index} ({ray.util.get_node_ip_address()}, Ray node {ray.get_runtime_context().get_node_id()[:8]})"

    def failure(self) -> str | None:
        """None while the server runs; else how it ended, with its log's end."""
        if self.server is None or (code := self.server.proc.poll()) is None:
            return None
        return (f"the vLLM server on {self.where()} exited with code {code}; last lines of "
                f"{self.server.log_path}:\n{helpers.log_tail(self.server, 15)}")  # fmt: skip

    def stop(self) -> None:
        if self.server is not None:
            helpers.stop_server(self.server)
        shutil.rmtree(self.workdir, ignore_errors=True)


def free_port(host: str) -> int:
    """A TCP port free on `host` now (for vLLM's DP handshake, which binds it itself)."""
    with socket.create_server((host, 0)) as s:
        return s.getsockname()[1]


def start_node_servers(pg, model: str, log_path: str, env: dict, flags_per_node: list[list[str]],
                       launcher=helpers.DEFAULT_LAUNCHER) -> list:  # fmt: skip
    """Nodes 1, 2, ... of placement group `pg`: a NodeServer actor in each
    node's bundle starts `vllm serve <model> <flags>` there, its log at
    `log_path` made absolute, with `.node<k>` before the suffix (on that
    node's disk). `model`: the model's directory as the driver resolved it
    (models.resolve_model), absolute, at the same path on every node; or a
    preset's name (its directory on the driver's node is private, so each
    node builds its own). Not `--model` as given: a relative path would
    resolve against each actor's working directory, and a Hugging Face id
    would be downloaded again on every node. Returns the actors, each
    already starting its server."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    actor, log = ray.remote(NodeServer), Path(log_path).absolute()  # a Ray worker's cwd is not ours
    servers = [actor.options(num_cpus=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
        pg, placement_group_bundle_index=k)).remote(k) for k in range(1, len(flags_per_node) + 1)]  # fmt: skip
    try:
        ray_get_all([server.start.remote(model, flags, str(log.with_suffix(f".node{k}{log.suffix}")), env, launcher)
                     for k, (server, flags) in enumerate(zip(servers, flags_per_node, strict=True), start=1)],
                    who="the Ray actor of a node's vLLM server")  # fmt: skip
    except BaseException:
        stop_node_servers(servers)  # those that did start
        raise
    return servers


class NodeServerFailed(helpers.ServerError):
    """The vLLM server of a node other than the first exited, or its NodeServer actor is lost."""


def raise_node_failure(node_servers: list, seen_as: Exception | None = None) -> None:
    """Raise a ServerError naming every node whose server has exited (or
    whose NodeServer actor is lost or does not answer), and how; `seen_as`:
    the error that made us look (raised as it is if it names them already,
    from an earlier look). Else return."""
    if isinstance(seen_as, NodeServerFailed):
        raise seen_as
    asked = [server.failure.remote() for server in node_servers]
    answered = set(ray.wait(asked, num_returns=len(asked), timeout=60)[0])  # 60 s for all of them together
    failures = []
    for k, ref in enumerate(asked, start=1):
        try:
            failures.append(ray.get(ref) if ref in answered else
                            f"the Ray actor of node {k}'s vLLM server does not answer (60 s)")  # fmt: skip
        except ray.exceptions.RayActorError as e:
            failures.append(f"the Ray actor of node {k}'s vLLM server is lost: {death_cause(e)}")
    if failures := [f for f in failures if f]:
        raise NodeServerFailed("\n".join(failures) + (f"\n(seen here as: {seen_as})" if seen_as else "")) from None


def wait_until_ready(server: helpers.Server, filling: list, timeout_s: float, node_servers: list = ()) -> float:
    """Wait for the trainers' weights and for the server's health, printing
    its progress; a failed rank, or a server that exits on any node, fails at
    once. Returns when the last rank's weights were in, in seconds into the
    server's start."""
    while filling and server.proc.poll() is None:
        done, filling = ray.wait(filling, num_returns=len(filling), timeout=2)
        ray_get_all(done)
        raise_node_failure(node_servers)
        helpers.print_progress(server)
    filled_after_s = time.monotonic() - server.started_at
    if not filling:  # else the server exited first, and wait_until_healthy says how
        print(f"[trainers] weights in, {filled_after_s:.0f} s into the server's start", flush=True)
    left = timeout_s - filled_after_s
    server.healthy_after_s = helpers.wait_until_healthy(server, left, also_check=lambda: raise_node_failure(node_servers))
    print(f"[server] healthy after {server.healthy_after_s:.1f} s at {server.socket_path}", flush=True)
    return filled_after_s


def stop_node_servers(node_servers: list) -> list:
    """Stop every node's server and wait until its processes are gone; what
    cannot be stopped this way (its node or actor lost) its watchdog stops.
    Returns [] (nothing left to stop)."""
    stops = [server.stop.remote() for server in node_servers]
    for k, stop in enumerate(stops, start=1):
        try:
            ray.get(stop, timeout=60)
        except Exception as e:  # keep going: the other nodes' servers still need stopping
            print(f"[shutdown] node {k}'s vLLM server: {death_cause(e)}", flush=True)
    return []


def cli(main_fn) -> None:
    """Run main_fn() and exit with its code; the failures we expect (a dead
    rank or server, no room for the trainers) as one `error:` line, Ctrl-C as
    one line too (the cleanup has run on the way out). Anything else keeps its
    traceback."""
    try:
        sys.exit(main_fn())
    except (PlacementError, TrainerDied, helpers.ServerError) as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        print("error: interrupted; the server and the trainers are stopped", file=sys.stderr)
        sys.exit(130)
