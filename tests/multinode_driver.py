# SPDX-License-Identifier: Apache-2.0
"""A driver on a two-node Ray cluster (ray.cluster_utils.Cluster, both nodes
on this machine, one fake GPU each): it places the trainers, plans each node's
`vllm serve`, starts and loses the second node's server through its
NodeServer actor, sends weights that fail while that server is dead, and
runs the script's colocated_job with a relative --model until the second
node's server starts, writing what it saw to the JSON file named by argv[1] for
test_multinode.py. A fake launcher stands in for `vllm serve`: vLLM on CPU
has no data-parallel MoE. Run in its own process: pytest's other tests share
one local Ray, and a process can join only one.
"""

import json
import os
import sys
import time
from functools import partial
from pathlib import Path

TESTS = Path(__file__).resolve().parent
sys.path[:0] = [str(TESTS), str(TESTS.parent)]

import ray  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.placement_group import placement_group_table  # noqa: E402

import conftest  # noqa: E402,F401  (its environment: no auth, offline, ...)
import helpers  # noqa: E402
import rlhf_ipc_fsdp_ep as script  # noqa: E402
from proof import program, report  # noqa: E402
from weight_sync import models, multinode, ray_trainers  # noqa: E402

SLEEPS = (
    sys.executable,
    "-c",
    "import os, time; print('engines starting, gloo on', "
    "os.environ.get('GLOO_SOCKET_IFNAME'), flush=True); time.sleep(600)",
)
FAILS = (sys.executable, "-c", "import sys; print('no GPU on this node'); sys.exit(3)")


@ray.remote(num_cpus=0)
class _SendFailsPartWay:
    """A trainer rank whose every send the server fails part way."""

    def __init__(self) -> None:
        self.count = 0

    def send_weights(self, empty_cache: bool = False) -> None:
        self.count += 1
        raise helpers.ServerError("POST /collective_rpc timed out (simulated)")

    def sends(self) -> int:
        return self.count


class _NoModelRank:
    """A trainer rank that builds no model: the job only has to get as far as the servers."""

    def build_model(self, model_path: str, lr: float | None = None) -> None:
        pass

    def init_weights(self, model_path: str, random_init: bool, seed: int = 0) -> int:
        return 0


class _Stop(Exception):
    pass


def _all_reduce_rank(trainer) -> float:
    total = torch.tensor([float(trainer.rank + 1)])
    dist.all_reduce(total)
    return total.item()


def _server_pid(node_server) -> int:
    return node_server.server.proc.pid


def _left_of_node_servers() -> list[str]:
    """Live processes (not zombies) whose command line names a NodeServer's
    private directory: its server, and the server's watchdog."""
    left = []
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        argv = program.cmdline(pid)
        if b"rlhf-ipc-node-" in argv and helpers.start_time(pid) is not None:
            left.append(argv.replace(b"\0", b" ").decode(errors="replace")[:200])
    return left


def _interface_with(ip: str) -> str | None:
    """The interface holding `ip`, asked of the kernel (SIOCGIFADDR), not of
    psutil as multinode.gloo_interface_env does."""
    import fcntl
    import socket
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
            except OSError:  # no IPv4 address
                continue
            if socket.inet_ntoa(packed[20:24]) == ip:
                return name
    return None


def _error_of(fn) -> str:
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _save_tiny_checkpoint(path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    models.build_preset("tiny", path)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.bfloat16)
    models.init_random_weights(model, seed=1)
    model.save_pretrained(path)


def _model_node1_serves(argv: list[str]) -> dict:
    """What `vllm serve` on node 1 is started with in place of the model, and
    the resolve_model passed for it (its name), when the script (its
    colocated_job, trainers on CPU) runs with `argv` from the current
    directory: the job stops once the node's server runs."""
    _save_tiny_checkpoint(Path("ckpt"))
    start_trainers, start_node_servers = script.start_trainers, script.start_node_servers
    originals = {name: getattr(script, name) for name in ("start_trainers", "start_node_servers", "RLTrainer")}
    served, resolvers = [], []

    def on_cpu(*args, **kwargs):
        return start_trainers(*args, **kwargs, gpus_per_trainer=1)

    def and_stop(pg, model, log_path, env, flags_per_node, **kwargs):
        resolvers.append(getattr(kwargs.get("resolve_model"), "__qualname__", None))
        servers = start_node_servers(pg, model, log_path, env, flags_per_node, launcher=SLEEPS, **kwargs)
        cmd = ray.get(servers[0].__ray_call__.remote(lambda node: list(node.server.proc.args)))
        served.append(cmd[cmd.index("serve") + 1])  # the watchdog's argv: `... -- <launcher> serve <model> ...`
        multinode.stop_node_servers(servers)
        raise _Stop

    for name, stand_in in zip(originals, (on_cpu, and_stop, _NoModelRank)):
        setattr(script, name, stand_in)
    try:
        with script.colocated_job(script.parse_args(argv)):
            pass
    except _Stop:
        pass
    except Exception as e:  # node 1's server did not start
        return {"serves": f"{type(e).__name__}: {e}", "resolve_model": None}
    finally:
        for name, original in originals.items():
            setattr(script, name, original)
    return {"serves": served[0] if served else "not started", "resolve_model": resolvers[0] if resolvers else None}


def main(out_path: str, log_dir: str) -> None:
    seen = {}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=2, num_gpus=1)
    # Set after the nodes started, as if exported only where the driver runs: job_env() carries them.
    os.environ.update(NCCL_SOCKET_IFNAME="from-the-driver", VLLM_HOST_IP="the-drivers-own")
    ray.init(address=cluster.address, log_to_driver=False, runtime_env={"env_vars": multinode.job_env()})
    try:
        seen["driver_node"] = ray.get_runtime_context().get_node_id()
        seen["one_node_for_two"] = _error_of(
            lambda: ray_trainers.start_trainers(script.FSDPTrainer, 2, num_nodes=1, placement_timeout_s=5)
        )

        trainers, pg = ray_trainers.start_trainers(
            script.FSDPTrainer, 2, num_nodes=2, rendezvous=multinode.TCPRendezvous
        )
        placements = ray_trainers.placements(trainers)
        seen["placements"] = placements
        seen["strategy"] = placement_group_table(pg)["strategy"]
        seen["all_reduce"] = ray_trainers.ray_get_all([t.__ray_call__.remote(_all_reduce_rank) for t in trainers])
        seen["node1_env"] = ray.get(
            trainers[1].__ray_call__.remote(
                lambda _: {k: os.environ.get(k) for k in ("NCCL_SOCKET_IFNAME", "VLLM_HOST_IP")}
            )
        )
        report.show_layout(placements, 2)
        seen["layout"] = [p["gpu_ids"] for p in placements]  # one rank per node here
        args = script.parse_args(["--model", "tiny", "--num-gpus", "2", "--num-nodes", "2"])
        head = (placements[0]["node_ip"], multinode.free_port(placements[0]["node_ip"]))
        seen["head"] = list(head)
        seen["flags"] = [script.serve_args(args, gpus, k, head) for k, gpus in enumerate(seen["layout"])]
        log = str(Path(log_dir) / "server.log")

        # A node's server that exits during the start: the wait ends at once, naming the node.
        first = helpers.start_server(
            ["m"], socket_path=conftest.private_socket_path(), log_path=Path(log_dir) / "head.log", launcher=SLEEPS
        )
        failing = multinode.start_node_servers(pg, "tiny", log, {}, seen["flags"][1:], launcher=FAILS)
        begin = time.monotonic()
        seen["failed_start"] = _error_of(
            lambda: ray_trainers.wait_until_ready(
                first, [], 120, also_check=partial(multinode.raise_node_failure, failing)
            )
        )
        seen["failed_start_s"] = time.monotonic() - begin
        helpers.stop_server(first)
        multinode.stop_node_servers(failing)

        # A node's server that dies mid-run is named when a request fails; stopping leaves nothing.
        os.chdir(log_dir)  # a relative --server-log: the node's log lands here, not in its actor's cwd
        running = multinode.start_node_servers(
            pg, "tiny", "server.log", {}, seen["flags"][1:], launcher=SLEEPS, resolve_model=models.resolve_model
        )
        pid = ray.get(running[0].__ray_call__.remote(_server_pid))
        # A preset, through resolve_model: node 1 serves a directory it built (the driver's is private to it).
        node1_model = ray.get(running[0].__ray_call__.remote(lambda node: node.server.proc.args))
        node1_model = node1_model[node1_model.index("serve") + 1]
        seen["node1_preset_config"] = (Path(node1_model) / "config.json").is_file() and node1_model
        seen["running_failure"] = ray.get(running[0].failure.remote())
        # Not a fixed wait: on a loaded machine the server may take seconds to print its first line.
        node1_log = Path(log_dir) / "server.node1.log"
        deadline = time.monotonic() + 60
        while (
            not any(line.startswith("engines starting") for line in node1_log.read_text().splitlines())
            and time.monotonic() < deadline
        ):  # (the log's first line, the command, names it too)
            time.sleep(0.1)
        seen["node1_log"] = node1_log.read_text()
        ip = placements[1]["node_ip"]
        seen["node1_interface"] = os.environ.get("GLOO_SOCKET_IFNAME") or _interface_with(ip)
        os.kill(pid, 9)
        deadline = time.monotonic() + 60  # until node 1's actor sees its server gone, not a fixed wait
        while ray.get(running[0].failure.remote()) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        seen["died_mid_run"] = _error_of(
            lambda: multinode.raise_node_failure(running, seen_as=helpers.ServerError("POST /sleep failed"))
        )
        # A send the server fails part way while node 1's server is dead (the first node's still
        # answers): not sent again, and node 1 named at once, as run_round calls send_all.
        senders = [_SendFailsPartWay.remote() for _ in range(2)]
        ray.get([s.__ray_ready__.remote() for s in senders])  # their workers' start is not the send's time
        begin = time.monotonic()
        seen["send_with_a_dead_node"] = _error_of(
            lambda: ray_trainers.send_all(senders, check_failure=partial(multinode.raise_node_failure, running))
        )
        seen["send_with_a_dead_node_s"] = time.monotonic() - begin
        seen["sends_with_a_dead_node"] = ray.get([s.sends.remote() for s in senders])
        multinode.stop_node_servers(running)

        # An actor lost with its server running (the driver gone, say): the watchdog stops it.
        orphaned = multinode.start_node_servers(pg, "tiny", log, {}, seen["flags"][1:], launcher=SLEEPS)
        pid = ray.get(orphaned[0].__ray_call__.remote(_server_pid))
        ray.kill(orphaned[0])
        deadline = time.monotonic() + 60
        while helpers.start_time(pid) is not None and time.monotonic() < deadline:
            time.sleep(0.2)
        seen["orphan_alive_after_s"] = None if helpers.start_time(pid) is None else 60
        deadline = time.monotonic() + 30  # the watchdog exits once it sees the group empty: not a fixed wait
        while _left_of_node_servers() and time.monotonic() < deadline:
            time.sleep(0.2)
        seen["left_after_stops"] = _left_of_node_servers()
        seen["log_files"] = sorted(os.listdir(log_dir))

        # The script given a relative path: node 1's server gets the directory the driver resolved.
        ray.util.remove_placement_group(pg)
        node1 = _model_node1_serves(
            ["--model", "ckpt", "--num-gpus", "2", "--num-nodes", "2", "--server-log", "job.log"]
        )
        seen["node1_serves"], seen["node1_resolver"] = node1["serves"], node1["resolve_model"]
        seen["ckpt"] = str(Path(log_dir, "ckpt").resolve())
    finally:
        with open(out_path, "w") as f:
            json.dump(seen, f, indent=1)
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
