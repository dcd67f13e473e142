# SPDX-License-Identifier: Apache-2.0
"""The fault matrix on one GPU. Each case starts the script (tiny model, eager
server, one GPU), waits for the output line that marks its phase, does its
fault, and records how the run ended and what it left behind: its processes,
and their GPU memory 10 s and 60 s after the exit. Then it starts the script
again (`--rounds 1`) to see that the next run works.

The faults: SIGINT to the driver's process group (what Ctrl-C sends), SIGTERM
and SIGKILL to the driver (what a scheduler sends), in each of start,
generation, sleep and send; the server, or its engine core, SIGKILLed in the
send; and a send the server refuses once (the retry: the round must then pass
the exact check and the gate). The send cases' server waits before each chunk
(tests/fault_worker.py), so that the fault lands in the send.

Every process of a case carries FAULT_CASE=<case> in its environment (Ray's
and vLLM's processes inherit it), which is how its leftovers are counted and
its GPU memory summed. The cases run side by side, STAGGER_S apart, each
server with a fixed KV cache (--kv-cache-memory-bytes: no memory profiling,
so servers can start together on one GPU).

    python scripts/gpu_fault_matrix.py OUT_DIR [CASE ...]

Writes OUT_DIR/faults.json (a list of {case, phase, signal, exit_code,
message, leftover_processes, gpu_mib_after_10s, gpu_mib_after_60s,
next_run_ok, ...}) and OUT_DIR/fault-logs.tgz.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = os.environ.get("PROGRAM", f"{sys.executable} {ROOT / 'scripts' / 'with_worker.py'} fault_worker.FaultWorker")
NEXT_PROGRAM = os.environ.get("NEXT_PROGRAM", f"{sys.executable} {ROOT / 'rlhf_ipc_fsdp_ep.py'}")
COMMON = (
    "--model tiny --num-gpus 1 --enforce-eager --gpu-memory-utilization 0.04 "
    f"--kv-cache-memory-bytes {2 << 30} --max-tokens 384"
)
GIB = 1 << 30

# The output line that marks a phase, and the line that says it is over.
PHASES = {
    "start": ("starting vllm serve", "[server] healthy after"),
    "generation": ("=== round 2/", "[sleep] ..."),
    "sleep": ("[sleep] ...", re.compile(r"^\[sleep\] \d", re.M)),
    "send": ("[send] ...", re.compile(r"^\[send\] \d", re.M)),
}
# case: (phase, fault, seconds after the marker, flags, environment)
CASES: dict[str, tuple] = {}
for phase, delay in (("start", 15), ("generation", 0.3), ("sleep", 0), ("send", 0.5)):
    # A larger KV cache makes the sleep (vLLM freeing it) long enough to land in.
    flags = f"--kv-cache-memory-bytes {4 * GIB}" if phase == "sleep" else ""
    env = {"FAULT_SLOW_CHUNK_S": "3"} if phase == "send" else {}
    for sig in ("SIGINT", "SIGTERM", "SIGKILL"):
        CASES[f"{phase}-{sig.lower()}"] = (phase, sig, delay, f"--rounds 100000 {flags}", env)
CASES["send-server-killed"] = ("send", "kill the API server", 0.5, "--rounds 100000", {"FAULT_SLOW_CHUNK_S": "3"})
CASES["send-engine-core-killed"] = ("send", "kill the engine core", 0.5, "--rounds 100000", {"FAULT_SLOW_CHUNK_S": "3"})
CASES["send-refused-once"] = (
    "send",
    "the server refuses a chunk once",
    None,
    "--rounds 3 --send-retries 1",
    {"FAULT_FAIL_ONCE_AT_SYNC": "2"},
)


def case_processes(case: str) -> list[int]:
    """The live processes (not zombies) whose environment holds FAULT_CASE=<case>."""
    found, needle = [], f"FAULT_CASE={case}\0".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read() + b"\0"
            with open(f"/proc/{pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if (environ.startswith(needle) or b"\0" + needle in environ) and state != b"Z":
            found.append(int(pid))
    return found


def gpu_mib(pids: list[int]) -> int | None:
    """GPU memory (MiB) that nvidia-smi lists for these processes; None without nvidia-smi."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    used = {int(p): int(m) for p, m in (line.split(", ") for line in out.splitlines() if ", " in line)}
    return sum(used.get(pid, 0) for pid in pids)


def gpu_total_mib() -> int | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        return int(out.split()[0])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return None


def start(cmd: str, case: str, log: Path, env: dict) -> subprocess.Popen:
    """The program in a process group of its own, as a terminal's foreground job is."""
    full_env = {**os.environ, **env, "FAULT_CASE": case, "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as out:
        # SIGINT as a terminal leaves it (a shell's background job, as this may be, starts with it ignored).
        return subprocess.Popen(
            cmd.split(),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=full_env,
            start_new_session=True,
            cwd=ROOT,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )


def wait_for(log: Path, marker: str, proc: subprocess.Popen, timeout_s: float = 900) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if marker in log.read_text(errors="replace"):
            return True
        time.sleep(0.005)
    return False


def server_process(case: str, engine_core: bool) -> int | None:
    """The case's vLLM API server (the `vllm serve` process, not its watchdog) or engine core."""
    for pid in case_processes(case):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if engine_core and b"EngineCore" in cmd:
            return pid
        if (
            not engine_core
            and (b"vllm.entrypoints.cli.main" in cmd or b"APIServer" in cmd)
            and b"helpers.server_watchdog" not in cmd
        ):
            return pid
    return None


def fault(proc: subprocess.Popen, case: str, what: str) -> str:
    if what == "SIGINT":
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the whole foreground group
    elif what in ("SIGTERM", "SIGKILL"):
        os.kill(proc.pid, getattr(signal, what))
    else:
        pid = server_process(case, engine_core="engine core" in what)
        if pid is None:
            return f"{what}: no such process found"
        os.kill(pid, signal.SIGKILL)
        return f"{what}: SIGKILL to pid {pid}"
    return f"{what} to pid {proc.pid}"


def last_phase(text: str) -> str | None:
    lines = re.findall(r"^(\[[a-z_]+\] \.\.\.|=== round \d+/\d+.*|\[trainers\] model sharded.*)$", text, re.M)
    return lines[-1] if lines else None


def message(text: str) -> str | None:
    """The run's own last word: its `error:` or `FAILED` line, else the last [shutdown] line."""
    for pattern in (r"^(error: .*)$", r"^(FAILED: .*)$", r"^(\[shutdown\] .*)$"):
        if found := re.findall(pattern, text, re.M):
            return found[-1][:400]
    return None


def run_case(name: str, out: Path, results: list, lock: threading.Lock) -> None:
    phase, what, delay, flags, env = CASES[name]
    log = out / "logs" / f"{name}.out"
    cmd = f"{PROGRAM} {COMMON} {flags} --server-log {out / 'logs' / f'{name}.server.log'}"
    record = {"case": name, "phase": phase, "signal": what, "command": cmd, "env": env}
    t0 = time.monotonic()
    proc = start(cmd, name, log, env)
    marker, done = PHASES[phase]
    if delay is None:  # no fault from here: the server's own
        record["reached_phase"] = True
    elif wait_for(log, marker, proc):
        time.sleep(delay)
        record["gpu_mib_while_running"] = gpu_mib(case_processes(name))
        text = log.read_text(errors="replace")
        after = text[text.index(marker) + len(marker) :]
        record.update(
            reached_phase=True,
            phase_at_fault=last_phase(text),
            fault_sent_after_s=round(time.monotonic() - t0, 1),
            # in the phase: it had not said it was over when the fault came
            landed_in_phase=not (done.search(after) if isinstance(done, re.Pattern) else done in after),
        )
        record["fault"] = fault(proc, name, what)
    else:
        record.update(reached_phase=False, phase_at_fault=last_phase(log.read_text(errors="replace")))
    fault_at = time.monotonic()
    try:
        proc.wait(timeout=900 if delay is None else 120)
    except subprocess.TimeoutExpired:
        record["did_not_exit"] = True
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    exited = time.monotonic()
    text = log.read_text(errors="replace")
    record.update(exit_code=proc.returncode, exit_after_s=round(exited - fault_at, 2), message=message(text))
    if delay is None:
        record.update(
            retried="retry 1 of" in text,
            exact_passed=text.count("[exact] "),
            gate_passed=len(re.findall(r"^\[gate\] .*: pass$", text, re.M)),
        )
    for wait_s in (10, 60):
        time.sleep(max(0.0, exited + wait_s - time.monotonic()))
        left = case_processes(name)
        record[f"leftover_processes_after_{wait_s}s"] = len(left)
        record[f"gpu_mib_after_{wait_s}s"] = gpu_mib(left)
        if wait_s == 60:  # what is left for good (at 10 s the watchdog may still be in its 10 s grace)
            record["leftover_processes"] = len(left)
        record[f"leftover_commands_after_{wait_s}s"] = [
            Path(f"/proc/{p}/cmdline").read_bytes()[:200].replace(b"\0", b" ").decode(errors="replace")
            for p in left
            if Path(f"/proc/{p}").exists()
        ]
    for pid in case_processes(name):  # leave nothing for the next case, whatever this one left
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    next_log = out / "logs" / f"{name}.next.out"
    next_cmd = f"{NEXT_PROGRAM} {COMMON} --rounds 1 --server-log {out / 'logs' / f'{name}.next.server.log'}"
    nxt = start(next_cmd, f"{name}-next", next_log, {})
    record["next_run_ok"] = nxt.wait() == 0
    record["next_run_exit_code"] = nxt.returncode
    with lock:
        results.append(record)
        print(
            json.dumps(
                {
                    k: record.get(k)
                    for k in (
                        "case",
                        "phase_at_fault",
                        "landed_in_phase",
                        "exit_code",
                        "message",
                        "leftover_processes",
                        "gpu_mib_after_10s",
                        "gpu_mib_after_60s",
                        "next_run_ok",
                    )
                }
            ),
            flush=True,
        )


def main() -> int:
    out = Path(sys.argv[1]).resolve()
    names = sys.argv[2:] or list(CASES)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    results, lock, threads = [], threading.Lock(), []
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for name in names:
        threads.append(threading.Thread(target=run_case, args=(name, out, results, lock)))
        threads[-1].start()
        time.sleep(float(os.environ.get("STAGGER_S", "8")))
    for t in threads:
        t.join()
    results.sort(key=lambda r: names.index(r["case"]))
    gpu = (
        subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True
        ).stdout.strip()
        if gpu_total_mib() is not None
        else None
    )
    commit = (
        os.environ.get("COMMIT")
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip()
    )
    (out / "faults.json").write_text(
        json.dumps(
            {
                "started": started,
                "gpu": gpu,
                "commit": commit or None,
                "gpu_mib_used_at_the_end": gpu_total_mib(),
                "cases": results,
            },
            indent=1,
        )
    )
    with tarfile.open(out / "fault-logs.tgz", "w:gz") as tar:
        tar.add(out / "logs", arcname="logs")
    shutil.rmtree(out / "logs")
    ok = all(r["leftover_processes"] == 0 and r["next_run_ok"] for r in results)
    print(f"{len(results)} cases; all left nothing and were followed by a working run: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
