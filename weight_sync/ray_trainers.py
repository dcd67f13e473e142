# SPDX-License-Identifier: Apache-2.0
"""The trainer ranks as Ray actors: one per GPU, placed by a Ray placement group, in one process group.

Copy it beside helpers.py for a trainer that Ray starts; a torchrun trainer needs none of it. Your trainer is a
class of your own, started as one Ray actor per GPU; its send_weights(empty_cache) calls its sender's send():

    trainers, pg = start_trainers(MyTrainer, num_gpus, trainer_args=(...))
    ranks = placements(trainers)  # each rank's GPU, as Ray gave it: serve on those
    ...
    send_all(trainers, empty_cache=freed)  # every rank's send_weights(), between sleep_for_sync and wake_to_serve

Call every rank at once, as they run collectives. A rank is of any class: these functions run in it through
Ray's __ray_call__. ray_get_all raises as soon as one rank fails, since the others may be waiting for it in a
collective, and names a rank whose process died.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import ray
import torch
import torch.distributed as dist

from helpers import Server, ServerError, print_progress, wait_until_healthy

COLLECTIVE_TIMEOUT = timedelta(minutes=10)  # longer than SERVER_CALL_TIMEOUT_S


class PlacementError(RuntimeError):
    """Ray cannot give every trainer rank its GPU on the nodes asked for."""


class TrainerDied(RuntimeError):
    """A trainer rank's process died: it was killed, ran out of memory, or crashed."""


_store = None  # on rank 0: the store the ranks meet at


def open_rendezvous(host: str, world_size: int, rendezvous=None) -> str | int:
    """On rank 0, open the store the ranks meet at; return its file's path, or its port if `rendezvous` opened it."""
    global _store
    if rendezvous is not None:
        _store, port = rendezvous.open(host, world_size, COLLECTIVE_TIMEOUT)
        return port
    folder = Path(tempfile.mkdtemp(prefix="rlhf-ipc-rendezvous-"))  # 0700: unlike a port, private to this user
    atexit.register(shutil.rmtree, folder, ignore_errors=True)  # when this rank exits normally
    path = folder / "store"
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))  # owner-only, created before torch opens it
    _store = file_store(path, world_size)
    return str(path)


def join_process_group(rank: int, world_size: int, host: str, where: str | int, rendezvous=None) -> None:
    """Join the process group at what open_rendezvous returned, with the same `rendezvous`."""
    if rendezvous is not None:
        store = rendezvous.join(rank, host, where, world_size, _store, COLLECTIVE_TIMEOUT)
    else:
        store = _store if rank == 0 else file_store(where, world_size)
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    dist.init_process_group(
        "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo",  # chunk barriers on gloo wait on the host
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )


def placement() -> dict:
    """Return the GPU and node Ray gave this rank; run it in the rank."""
    info = {
        "rank": dist.get_rank(),
        "pid": os.getpid(),
        "gpu_ids": [str(i) for i in ray.get_gpu_ids()],
        "node": ray.get_runtime_context().get_node_id(),
        "node_ip": ray.util.get_node_ip_address(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu_name=props.name, gpu_uuid=str(props.uuid))
    return info


def placements(trainers: list) -> list[dict]:
    return ray_get_all([t.__ray_call__.remote(_in_rank, placement) for t in trainers])


def _in_rank(_trainer, fn, *args):
    return fn(*args)  # __ray_call__ passes the actor first: run `fn` without it


def file_store(path: str | os.PathLike, world_size: int) -> dist.FileStore:
    """Open a FileStore with the collectives' timeout; torch reopens the file, so keep it while the ranks run."""
    store = dist.FileStore(str(path), world_size)
    store.set_timeout(COLLECTIVE_TIMEOUT)
    return store


_rendezvous_dirs: dict[str, Path] = {}  # placement group id -> the directory of its trainers' FileStore


def remove_rendezvous(pg) -> None:
    if (where := _rendezvous_dirs.pop(pg.id.hex(), None)) is not None:
        shutil.rmtree(where, ignore_errors=True)


@atexit.register
def _remove_rendezvous_left() -> None:
    """At exit, remove what remove_rendezvous missed: Ray stops a job's trainers with its driver anyway."""
    for where in _rendezvous_dirs.values():
        shutil.rmtree(where, ignore_errors=True)


def start_trainers(
    trainer_cls: type,
    num_trainers: int,
    num_nodes: int = 1,
    gpus_per_trainer: float = 1,
    placement_timeout_s: float = 60,
    trainer_args: tuple = (),
    rendezvous=None,
) -> tuple[list, object]:
    """Start `num_trainers` Ray actors of `trainer_cls`, any class, in one process group; return them and their pg."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if num_nodes > 1 and rendezvous is None:
        raise ValueError(
            f"trainer ranks on {num_nodes} nodes meet over TCP, which weight_sync/ray_trainers.py does not do alone: copy "
            "weight_sync/multinode.py beside it and pass start_trainers(..., rendezvous=multinode.TCPRendezvous)"
        )
    rendezvous = rendezvous if num_nodes > 1 else None
    have = ray.cluster_resources().get("GPU", 0)
    if gpus_per_trainer and have < num_trainers * gpus_per_trainer:
        raise PlacementError(f"asked for {num_trainers} GPUs but the Ray cluster has {have:g}")
    per_node = num_trainers // num_nodes
    here = ray.get_runtime_context().get_node_id()
    here_gpus = next(n["Resources"].get("GPU", 0) for n in ray.nodes() if n["NodeID"] == here)
    if here_gpus < per_node * gpus_per_trainer:
        raise PlacementError(
            f"this node has {here_gpus:g} GPUs in Ray, and needs {per_node * gpus_per_trainer:g}: "
            "run the script on a GPU node (it runs vLLM's API server and trainer rank 0)"
        )
    # One bundle per node, the first on this one: CUDA IPC needs each rank on its GPU's engine's machine.
    bundle = {"CPU": per_node, **({"GPU": per_node * gpus_per_trainer} if gpus_per_trainer else {})}
    pg = placement_group(
        [bundle] * num_nodes,
        strategy="STRICT_SPREAD" if num_nodes > 1 else "STRICT_PACK",
        bundle_label_selector=[{"ray.io/node-id": here}] + [{}] * (num_nodes - 1),
    )
    if not pg.wait(timeout_seconds=placement_timeout_s):
        ray.util.remove_placement_group(pg)
        raise PlacementError(
            f"Ray could not place {num_trainers} trainers on {num_nodes} node(s) ({bundle} on each, "
            f"the first one this node) within {placement_timeout_s:.0f}s; cluster resources: "
            f"{ray.cluster_resources()}"
        )
    actor = trainer_cls if isinstance(trainer_cls, ray.actor.ActorClass) else ray.remote(trainer_cls)
    try:
        trainers = [
            actor.options(
                num_cpus=1,
                num_gpus=gpus_per_trainer,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, r // per_node),
            ).remote(*trainer_args)
            for r in range(num_trainers)
        ]
        # Meet on loopback on one node; on more, at rank 0's address, which the other nodes can reach.
        host = "127.0.0.1" if num_nodes == 1 else ray.util.get_node_ip_address()
        opened = trainers[0].__ray_call__.remote(_in_rank, open_rendezvous, host, num_trainers, rendezvous)
        where = ray_get_all([opened])[0]
        if isinstance(where, str):  # one node: the FileStore's path, in a directory of its own
            _rendezvous_dirs[pg.id.hex()] = Path(where).parent
        ray_get_all(
            [
                t.__ray_call__.remote(_in_rank, join_process_group, r, num_trainers, host, where, rendezvous)
                for r, t in enumerate(trainers)
            ]
        )
    except BaseException:  # a rank failed to start, or Ctrl-C: the caller never gets `pg` to remove
        ray.util.remove_placement_group(pg)  # which stops its trainers too
        remove_rendezvous(pg)
        raise
    return trainers, pg


def leave_ray(started_ray: bool, pg) -> None:
    """Shut Ray down if we started it, else remove our placement group; remove the rendezvous directory too."""
    if started_ray:
        ray.shutdown()
    elif pg is not None:
        ray.util.remove_placement_group(pg)
    if pg is not None:
        remove_rendezvous(pg)


def ray_get_all(refs: list, who: str = "a trainer rank", also_check=None):
    """ray.get(refs), but raise as soon as one fails, as the others may wait for it; a dead actor is TrainerDied."""
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=None if also_check is None else 2)
        if not done:
            also_check()
            continue
        try:
            ray.get(done[0])
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, ServerError):
                raise ServerError(f"{who}: {e.cause}") from None
            raise
        except ray.exceptions.RayActorError as e:
            raise TrainerDied(f"{who}'s process died: {death_cause(e)}") from e
    return ray.get(refs)


def death_cause(error: Exception) -> str:
    """Return the first line of Ray's report, plus the error that killed the actor if it names one."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    cause = [line for line in lines if line.split(":")[0].endswith(("Error", "Exception"))]
    return lines[0] + (f" ... {cause[-1]}" if cause and cause[-1] != lines[0] else "")


def send_all(trainers: list, empty_cache: bool = False, check_failure=None) -> tuple[list, int]:
    """Call send_weights(empty_cache) on every rank; return their results and how often the send was repeated.

    Each rank's WeightSender.send retries and agrees with the others; `check_failure`, given the error of a failed
    send, may raise a better cause, such as another node's dead server."""
    try:
        results = ray_get_all([t.send_weights.remote(empty_cache=empty_cache) for t in trainers])
    except ServerError as e:
        if check_failure:
            check_failure(e)
        raise
    return results, max((r for r in results if isinstance(r, int)), default=0)


def wait_until_ready(server: Server, filling: list, timeout_s: float, also_check=None) -> float:
    """Wait for the `filling` refs, then for health; return when the weights were in, in seconds since start."""
    while filling and server.proc.poll() is None:
        done, filling = ray.wait(filling, num_returns=len(filling), timeout=2)
        ray_get_all(done)
        if also_check:
            also_check()
        print_progress(server)
    filled_after_s = time.monotonic() - server.started_at
    if not filling:  # else the server exited first, and wait_until_healthy reports how
        print(f"[trainers] weights in, {filled_after_s:.0f} s into the server's start", flush=True)
    server.healthy_after_s = wait_until_healthy(server, timeout_s - filled_after_s, also_check=also_check)
    told = f", given its flags at {server.serving_after_s:.1f} s" if server.serving_after_s is not None else ""
    print(f"[server] healthy after {server.healthy_after_s:.1f} s{told} at {server.socket_path}", flush=True)
    return filled_after_s
