"""Plumbing for rlhf_ipc_fsdp_ep.py: the vLLM server's life cycle, one small
function per HTTP route, the tiny test model, and the numbers we report.

Everything here is usable on its own, without Ray or a GPU:

    server = start_server(["Qwen/Qwen3-30B-A3B", "--load-format", "dummy"], port=8000)
    wait_until_healthy(server, timeout_s=600)
    print(completions(server.url, "Qwen/Qwen3-30B-A3B", ["Hello"], max_tokens=8))
    stop_server(server)
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


class ServerError(RuntimeError):
    """The vLLM server failed to start, died, or answered a route with an error."""


# ---------------------------------------------------------------------------
# The server process
# ---------------------------------------------------------------------------

# Run the CLI through Python: it works where no `vllm` console script is installed.
DEFAULT_LAUNCHER = (sys.executable, "-m", "vllm.entrypoints.cli.main")

# Set by the server's environment: the dev routes (/sleep, /wake_up,
# /collective_rpc, weight transfer) exist only in dev mode, and the IPC handles
# arrive pickled, which vLLM refuses to unpickle unless told to. Both are safe
# only because the server listens on 127.0.0.1 (see start_server).
SERVER_ENV = {
    "VLLM_SERVER_DEV_MODE": "1",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
}


@dataclass
class Server:
    """A running `vllm serve` and where to reach it."""

    proc: subprocess.Popen
    port: int
    log_path: Path
    host: str = "127.0.0.1"
    started_at: float = field(default_factory=time.monotonic)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pgid(self) -> int:
        # start_new_session=True makes the server the leader of its own group.
        return self.proc.pid


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether the server could listen on host:port now. SO_REUSEADDR, as the
    server's own socket sets it: connections a stopped server left in
    TIME_WAIT do not block the port, a socket bound or listening there does."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def start_server(
    serve_args: Sequence[str],
    *,
    port: int,
    log_path: str | os.PathLike | None = None,
    env: dict[str, str] | None = None,
    launcher: Sequence[str] = DEFAULT_LAUNCHER,
) -> Server:
    """Start `vllm serve <serve_args>` on 127.0.0.1:port in its own process group.

    Output goes to `log_path` (a temp file if None). `env` is merged over this
    process's environment and SERVER_ENV. Ray's GPU mask is popped from it
    (a caller inside Ray would otherwise hand the server one GPU): pass
    `--device-ids` to choose GPUs instead.
    """
    if not port_is_free(port):
        raise ServerError(
            f"port {port} on 127.0.0.1 is already in use; stop what holds it or pass another --port"
        )
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix="vllm-serve-", suffix=".log")
        os.close(fd)
    log_path = Path(log_path)
    full_env = {**os.environ, **SERVER_ENV, **(env or {})}
    full_env.pop("CUDA_VISIBLE_DEVICES", None)
    cmd = [*launcher, "serve", *serve_args, "--host", "127.0.0.1", "--port", str(port)]
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        # A new session: the server's API servers, engine cores and DP
        # coordinator all share its process group, so stop_server can signal
        # every one of them, not only the parent.
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=full_env,
            start_new_session=True,
        )
    return Server(proc=proc, port=port, log_path=log_path)


def log_tail(server: Server, lines: int = 40) -> str:
    try:
        text = server.log_path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def wait_until_healthy(server: Server, timeout_s: float = 900, poll_s: float = 1.0) -> float:
    """Block until GET /health answers 200; return seconds since start.

    Raises ServerError at once if the process exits, or when the deadline
    passes, quoting the end of the server's log either way.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        code = server.proc.poll()
        if code is not None:
            raise ServerError(
                f"vLLM server exited with code {code} during start; last lines of "
                f"{server.log_path}:\n{log_tail(server)}"
            )
        if health(server.url):
            return time.monotonic() - server.started_at
        if time.monotonic() > deadline:
            raise ServerError(
                f"vLLM server not healthy after {timeout_s:.0f}s; last lines of "
                f"{server.log_path}:\n{log_tail(server)}"
            )
        time.sleep(poll_s)


def group_members(pgid: int) -> list[int]:
    """PIDs still alive in process group `pgid` (Linux /proc), zombies excluded."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # Fields after the ")" closing the command name: state ppid pgrp ...
        state, _ppid, pgrp = stat.rsplit(")", 1)[1].split()[:3]
        if int(pgrp) == pgid and state != "Z":
            pids.append(int(entry))
    return pids


def _wait_group_gone(server: Server, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while group_members(server.pgid):
        server.proc.poll()  # reap the parent so it does not linger as a zombie
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def stop_server(server: Server, grace_s: float = 20.0) -> None:
    """SIGTERM the server's whole process group, SIGKILL what is left after
    `grace_s`, and wait until every process is gone. Safe to call twice."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(server.pgid, sig)
        except ProcessLookupError:
            break
        if _wait_group_gone(server, wait_s):
            break
    else:
        raise ServerError(f"processes {group_members(server.pgid)} of the vLLM server survived SIGKILL")
    try:
        server.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


# ---------------------------------------------------------------------------
# HTTP routes: one small function each
# ---------------------------------------------------------------------------


def _request(method: str, url: str, route: str, timeout: float = 600, **kwargs) -> Any:
    """Call a route; return its JSON; raise ServerError with the server's own
    error text (requests' raise_for_status drops it)."""
    try:
        resp = requests.request(method, f"{url}{route}", timeout=timeout, **kwargs)
    except requests.RequestException as e:
        raise ServerError(f"{method} {route} failed: {e}") from e
    if resp.status_code != 200:
        raise ServerError(f"{method} {route} -> HTTP {resp.status_code}: {resp.text[:2000]}")
    return resp.json() if resp.content else None


def health(url: str) -> bool:
    try:
        return requests.get(f"{url}/health", timeout=5).status_code == 200
    except requests.RequestException:
        return False


def sleep(url: str, level: int) -> dict:
    """POST /sleep: level 1 offloads weights to CPU, level 2 discards them;
    both free the KV cache and pause scheduling."""
    return _request("POST", url, "/sleep", params={"level": level})


def wake_up(url: str, tags: Iterable[str] | None = None) -> dict:
    """POST /wake_up?tags=...: map back the named memory pools (all if None)."""
    params = [("tags", t) for t in tags] if tags else None
    return _request("POST", url, "/wake_up", params=params)


def is_sleeping(url: str) -> bool:
    return _request("GET", url, "/is_sleeping")["is_sleeping"]


def get_world_size(url: str, include_dp: bool = True) -> int:
    return _request("GET", url, "/get_world_size", params={"include_dp": include_dp})["world_size"]


def start_weight_update(url: str) -> None:
    _request("POST", url, "/start_weight_update")


def finish_weight_update(url: str) -> None:
    _request("POST", url, "/finish_weight_update")


def init_weight_transfer_engine(url: str, init_info: dict) -> None:
    _request("POST", url, "/init_weight_transfer_engine", json={"init_info": init_info})


def weight_checker(url: str, action: str, baseline: dict | None = None) -> dict:
    """POST /weight_checker: 'reset' zeroes every parameter, 'checksum' returns
    {key: sha256}, 'compare' checks against a baseline."""
    body: dict[str, Any] = {"action": action}
    if baseline is not None:
        body["baseline"] = baseline
    return _request("POST", url, "/weight_checker", json=body)


@dataclass
class Completion:
    text: str
    prompt_token_ids: list[int]
    token_ids: list[int]


def _completion_request(url: str, body: dict, dp_rank: int | None) -> dict:
    """POST /v1/completions (greedy unless body sets a temperature); `dp_rank`
    pins it to one DP engine."""
    headers = {"X-data-parallel-rank": str(dp_rank)} if dp_rank is not None else None
    return _request("POST", url, "/v1/completions", headers=headers, json={"temperature": 0, **body})


def completions(
    url: str,
    model: str,
    prompts: list[str],
    max_tokens: int,
    temperature: float = 0.0,
    dp_rank: int | None = None,
) -> list[Completion]:
    """One completion per prompt (greedy by default), with the prompt's and
    the output's token ids."""
    body = {
        "model": model,
        "prompt": prompts,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "return_token_ids": True,
    }
    out = _completion_request(url, body, dp_rank)
    by_index = {c["index"]: c for c in out["choices"]}
    return [
        Completion(c["text"], list(c["prompt_token_ids"]), list(c["token_ids"]))
        for c in (by_index[i] for i in range(len(prompts)))
    ]


def prompt_logprobs(url: str, model: str, token_ids: list[int], dp_rank: int | None = None) -> list[float]:
    """vLLM's log-probability of each prompt token given the ones before it
    (len(token_ids) - 1 values). `dp_rank` pins the request to one DP engine."""
    body = {"model": model, "prompt": token_ids, "max_tokens": 1, "prompt_logprobs": 0}
    out = _completion_request(url, body, dp_rank)
    per_position = out["choices"][0]["prompt_logprobs"]
    # Position 0 has no context (None); each later entry maps token id -> info
    # and always holds the prompt's own token.
    return [entry[str(tok)]["logprob"] for tok, entry in zip(token_ids[1:], per_position[1:], strict=True)]


def collective_rpc(url: str, method: str, *args: str, timeout: float = 600) -> list:
    """POST /collective_rpc: call `method` on the worker of every engine
    (string arguments only). Returns the first DP engine's results; an error
    on any engine fails the call."""
    body = {"method": method, "args": list(args), "timeout": timeout}
    out = _request("POST", url, "/collective_rpc", timeout=timeout + 30, json=body)
    return out["results"] if out else []


def weight_sync_client(url: str):
    """vLLM's HTTPVLLMWeightSyncClient, except that a failing route raises
    ServerError quoting the server's reply instead of a bare HTTP status."""
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    class WeightSyncClient(HTTPVLLMWeightSyncClient):
        def _post(self, path: str, json: dict | None = None) -> None:
            _request("POST", self.base_url, f"/{path}", timeout=self.timeout, json=json)

    return WeightSyncClient(url)


class DirectLoadClient:
    """The same four calls as vLLM's HTTPVLLMWeightSyncClient, sent to the
    server's direct loader (direct_load.py) through /collective_rpc instead of
    vLLM's weight routes. Used on trainer rank 0, the only one that posts."""

    def __init__(self, url: str, trainer_gpu_uuids: list[str], timeout: float = 600) -> None:
        self.url = url
        self.trainer_gpu_uuids = list(trainer_gpu_uuids)
        self.timeout = timeout

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        if not init_info.get("packed"):
            raise ValueError("the direct loader reads packed IPC buffers: use packed=True")

    def start_weight_update(self) -> None:
        collective_rpc(self.url, "direct_load_start", timeout=self.timeout)

    def update_weights(self, update_info: dict) -> None:
        import base64
        import pickle

        update = {**update_info, "trainer_gpu_uuids": self.trainer_gpu_uuids}
        payload = base64.b64encode(pickle.dumps(update)).decode()
        collective_rpc(self.url, "direct_load_chunk", payload, timeout=self.timeout)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        collective_rpc(self.url, "direct_load_finish", timeout=self.timeout)

    def shutdown_weight_transfer_engine(self) -> None:
        pass


class TimedSource:
    """Wraps a weight source; adds the seconds spent producing its tensors
    (FSDP gathers and casts) to seconds["source"]. `synchronize` waits for the
    device, so GPU time counts and not only the kernel launches."""

    def __init__(self, source, seconds: dict[str, float], synchronize) -> None:
        self._source = source
        self._seconds = seconds
        self._synchronize = synchronize

    def metadata(self):
        return self._source.metadata()

    def __iter__(self):
        items = iter(self._source)
        while True:
            start = time.perf_counter()
            item = next(items, None)
            self._synchronize()
            self._seconds["source"] = self._seconds.get("source", 0.0) + time.perf_counter() - start
            if item is None:
                return
            yield item


class TimedClient:
    """Wraps a weight sync client; adds the seconds spent in each of its calls
    (the server's share of a send, as the sender sees it) to `seconds`."""

    def __init__(self, client, seconds: dict[str, float]) -> None:
        self._client = client
        self._seconds = seconds

    def __getattr__(self, name: str):
        call = getattr(self._client, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                key = f"server_{name}"
                self._seconds[key] = self._seconds.get(key, 0.0) + time.perf_counter() - start
                self._seconds[f"{key}_calls"] = self._seconds.get(f"{key}_calls", 0) + 1

        return timed


# ---------------------------------------------------------------------------
# The tiny model (no download)
# ---------------------------------------------------------------------------

# Models built locally from a config, with random weights: nothing is downloaded.
# "tiny" has the 30B-A3B's structure at toy size (head_dim >= 32 keeps vLLM's CPU
# attention happy; 8 experts split evenly over 1, 2, 4 or 8 EP ranks).
# "qwen3-30b-a3b-shape" has Qwen/Qwen3-30B-A3B's exact shapes (61 GB in bf16).
_QWEN3_MOE_COMMON = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
MODEL_PRESETS = {
    "tiny": {
        **_QWEN3_MOE_COMMON,
        "vocab_size": 1024,
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 2048,
    },
    "qwen3-30b-a3b-shape": {
        **_QWEN3_MOE_COMMON,
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "max_position_embeddings": 40960,
    },
}

_TOKENIZER_CORPUS = (
    "The capital of France is Paris. The future of AI is bright. Hello, my name is "
    "Ada and I like to train models. Reinforcement learning from human feedback "
    "moves weights from a trainer into an inference server after every step. "
    "The quick brown fox jumps over the lazy dog. One two three four five six "
    "seven eight nine ten. Experts route tokens; attention mixes them."
)


def build_preset_model(name: str, out_dir: str | os.PathLike) -> Path:
    """Write config.json for MODEL_PRESETS[name] and a small byte-level BPE
    tokenizer (a few hundred tokens; the config's vocabulary is larger).

    No weight files: the server starts with --load-format dummy and the
    trainer initialises random weights, so nothing is downloaded.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    specials = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2 as in the config
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([_TOKENIZER_CORPUS] * 4, trainer=trainer)
    PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(out)
    (out / "config.json").write_text(json.dumps(MODEL_PRESETS[name], indent=2))
    return out


def largest_parameter(model_path: str | os.PathLike) -> tuple[str, int]:
    """(name, bytes in bf16) of the model's largest parameter, read from its
    config on the meta device: no weights are loaded, nothing is allocated."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    name, param = max(model.named_parameters(), key=lambda kv: kv[1].numel())
    return name, param.numel() * param.element_size()


# ---------------------------------------------------------------------------
# Numbers we report
# ---------------------------------------------------------------------------


def other_processes_gpu_memory(gpu_uuid: str) -> float:
    """Bytes of GPU memory that processes other than this one use on the GPU
    with this UUID (NVML; NaN if NVML cannot tell)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            uuid = gpu_uuid if gpu_uuid.startswith("GPU-") else f"GPU-{gpu_uuid}"
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
            if os.getpid() not in {p.pid for p in procs}:
                return math.nan  # NVML sees another PID namespace: it cannot tell us apart
            return float(sum(p.usedGpuMemory or 0 for p in procs if p.pid != os.getpid()))
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML, no permission, a container hiding PIDs
        return math.nan


@dataclass
class LogprobDiff:
    max_abs: float
    mean_abs: float
    count: int


def logprob_diff(reference: list[list[float]], other: list[list[float]]) -> LogprobDiff:
    """max and mean |a - b| over every token of every prompt. NaN anywhere
    makes max NaN, which fails any `<= tolerance` gate."""
    diffs: list[float] = []
    for ref, oth in zip(reference, other, strict=True):
        if len(ref) != len(oth):
            raise ValueError(f"prompt lengths differ: {len(ref)} vs {len(oth)}")
        diffs += [abs(a - b) for a, b in zip(ref, oth, strict=True)]
    if not diffs:
        raise ValueError("no tokens to compare")
    worst = math.nan if any(math.isnan(d) for d in diffs) else max(diffs)
    return LogprobDiff(max_abs=worst, mean_abs=sum(diffs) / len(diffs), count=len(diffs))


class PhaseTimer:
    """Wall-clock seconds per named phase: `with timer.phase("sleep"): ...`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str, echo: bool = True):
        if echo:
            print(f"[{name}] ...", flush=True)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = time.perf_counter() - start
            if echo:
                print(f"[{name}] {self.seconds[name]:.2f} s", flush=True)


SYNC_PHASES = ("sleep", "wake_weights", "send", "wake_kv")


def format_summary(result: dict) -> str:
    """A plain-text table of a run's JSON result (see rlhf_ipc_fsdp_ep.py)."""
    train = any("reward_mean" in r for r in result["rounds"])
    lines = [
        f"model {result['model']} | {result['num_gpus']} x {result['gpu_name']} | "
        f"vLLM {result['vllm_version']} | server start {result['server_start_s']:.1f} s",
        "",
        "round | "
        + " | ".join(f"{p:>12}" for p in SYNC_PHASES)
        + " |    cycle |     bytes |   GB/s | mean|dlogp| before -> after | max after | changed | gate"
        + (" |    train | reward" if train else ""),
    ]
    for i, r in enumerate(result["rounds"], 1):
        ph = r["phases_s"]
        line = (
            f"{i:>5} | "
            + " | ".join(f"{ph[p]:>10.3f} s" for p in SYNC_PHASES)
            + f" | {r['cycle_s']:>6.2f} s | {r['bytes_sent'] / 1e9:>7.3f}GB | "
            f"{r['send_gb_per_s']:>6.2f} | {r['mean_abs_dlogp_before']:>14.4f} -> "
            f"{r['mean_abs_dlogp_after']:<8.4f} | {r['max_abs_dlogp_after']:>9.4f} | "
            f"{'yes' if r['logprobs_changed'] else 'no':>7} | "
            f"{'pass' if r['gate_passed'] else 'FAIL'}"
        )
        if train:
            line += f" | {ph['train']:>6.2f} s | {r['reward_mean']:.3f}"
        lines.append(line)
    lines += ["", "GPU | trainer peak alloc | trainer reserved | server (NVML) | GPU used (all processes)"]
    for rank, m in enumerate(result["memory_gib_per_rank"]):
        lines.append(
            f"{rank:>3} | {m['trainer_peak_allocated']:>14.2f} GiB | "
            f"{m['trainer_reserved']:>12.2f} GiB | {m.get('server_used', math.nan):>9.2f} GiB | "
            f"{m['device_used']:>10.2f} GiB"
        )
    if len(result["rounds"]) >= 3:
        lines.append(f"GPU memory growth, round 2 -> last: {result['memory_growth_gib']:+.3f} GiB")
    return "\n".join(lines)
