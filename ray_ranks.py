"""Placing, calling and stopping what rlhf_ipc_fsdp_ep.py runs on the Ray cluster.

Every rank of the trainer takes part in collectives, so a call is made on all
of them at once and must not wait on a rank that is gone:

  start_trainers  one trainer rank per GPU, on whole nodes, rank 0 on this one
  ray_get_all     every rank's result, failing at the first error (a dead rank
                  as TrainerDied, naming why; a server error as itself)
  send_all        one weight sync on every rank, sent again when the server
                  failed it part way (--send-retries)
  NodeServer      an actor that owns the headless `vllm serve` of another node
  leave_ray       Ray left as we found it
  cli             a program's failures as one `error:` line, not a traceback
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import ray

import helpers


class PlacementError(RuntimeError):
    """Ray cannot give every trainer rank its GPU on the nodes asked for."""


class TrainerDied(RuntimeError):
    """A trainer rank's process died (killed, out of memory, crashed)."""


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
    actor = ray.remote(trainer_cls)
    trainers = [
        actor.options(num_cpus=1, num_gpus=gpus_per_trainer, scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=r // per_node)).remote(r, num_trainers, device_type)
        for r in range(num_trainers)
    ]  # fmt: skip
    # One node: rendezvous on loopback. More: on rank 0's address, which the other nodes reach.
    host = "127.0.0.1" if num_nodes == 1 else ray.util.get_node_ip_address()
    port = ray_get_all([trainers[0].open_rendezvous.remote(host)])[0]
    ray_get_all([t.join_process_group.remote(host, port) for t in trainers])
    return trainers, pg


def leave_ray(started_ray: bool, pg) -> None:
    """Leave Ray as we found it: shut down if we started it (again is a no-op),
    else our placement group removed, and the trainers with it."""
    if started_ray:
        ray.shutdown()
    elif pg is not None:
        ray.util.remove_placement_group(pg)


def ray_get_all(refs: list, who: str = "a trainer rank"):
    """ray.get(refs), but raise as soon as any one fails: the others may be
    blocked in a collective waiting for it. A ServerError (the server
    refused or died) is raised as itself, prefixed by `who` raised it; a dead
    rank as TrainerDied."""
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(done[0])
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, helpers.ServerError):
                raise helpers.ServerError(f"{who}: {e.cause}") from None
            raise
        except ray.exceptions.RayActorError as e:
            raise TrainerDied(f"a trainer rank's process died: {death_cause(e)}") from e
    return ray.get(refs)


def death_cause(error: Exception) -> str:
    """The first line of Ray's report, and the error that killed the actor if
    it names one (e.g. CUDA out of memory in the constructor)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    cause = [line for line in lines if line.split(":")[0].endswith(("Error", "Exception"))]
    return lines[0] + (f" ... {cause[-1]}" if cause and cause[-1] != lines[0] else "")


def send_all(trainers: list, sock: str, retries: int = 0) -> tuple[list, int]:
    """send_weights() on every rank; returns what each rank reports and how
    many times the send was retried. A send the server failed part way (an
    HTTP error, a refused chunk, a timeout) is sent again from the start, up to
    `retries` times: vLLM is still asleep, and every weight is re-sent. A dead
    rank (TrainerDied) or a dead server is not retried."""
    first = why = None
    for attempt in range(retries + 1):
        sends = [t.send_weights.remote() for t in trainers]
        try:
            return ray_get_all(sends), attempt
        except helpers.ServerError as e:
            first = first or e
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
        this node is, for messages. A preset model is built on this node."""
        import models

        try:
            model_path = models.resolve_model(model, self.workdir)
        except SystemExit as e:  # its one-line error, for this node
            raise helpers.ServerError(f"{self.where()}: {e}") from None
        self.server = helpers.start_server([str(model_path), *serve_flags], socket_path=self.workdir / "vllm.sock",
                                           log_path=log_path, env=env, launcher=launcher)  # fmt: skip
        return self.where()

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


def start_node_servers(pg, model: str, log_path: str, env: dict, flags_per_node: list[list[str]],
                       launcher=helpers.DEFAULT_LAUNCHER) -> list:  # fmt: skip
    """Nodes 1, 2, ... of placement group `pg`: a NodeServer actor in each
    node's bundle starts `vllm serve <model> <flags>` there, its log at
    `log_path` with `.node<k>` before the suffix (on that node's disk).
    Returns the actors, each already starting its server."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    actor, log = ray.remote(NodeServer), Path(log_path)
    servers = [actor.options(num_cpus=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
        pg, placement_group_bundle_index=k)).remote(k) for k in range(1, len(flags_per_node) + 1)]  # fmt: skip
    try:
        ray_get_all([server.start.remote(model, flags, str(log.with_suffix(f".node{k}{log.suffix}")), env, launcher)
                     for k, (server, flags) in enumerate(zip(servers, flags_per_node, strict=True), start=1)],
                    who="a node's vLLM server")  # fmt: skip
    except BaseException:
        stop_node_servers(servers)  # those that did start
        raise
    return servers


def raise_node_failure(node_servers: list, seen_as: Exception | None = None) -> None:
    """Raise a ServerError naming the first node whose server has exited (or
    whose NodeServer actor is lost), and how; `seen_as`: the error that made
    us look. Else return."""
    for k, server in enumerate(node_servers, start=1):
        try:
            failure = ray.get(server.failure.remote(), timeout=60)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            failure = f"the actor that owns node {k}'s vLLM server is lost: {death_cause(e)}"
        if failure:
            raise helpers.ServerError(failure + (f"\n(seen here as: {seen_as})" if seen_as else "")) from None


def stop_node_servers(node_servers: list) -> list:
    """Stop every node's server and wait until its processes are gone; what
    cannot be stopped this way (its node or actor lost) its watchdog stops.
    Returns [] (nothing left to stop)."""
    for server in node_servers:
        try:
            ray.get(server.stop.remote(), timeout=60)
        except Exception as e:  # keep going: the other nodes' servers still need stopping
            print(f"[shutdown] a node's vLLM server: {death_cause(e)}", flush=True)
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
