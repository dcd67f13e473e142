# SPDX-License-Identifier: Apache-2.0
"""The server cannot outlive the process that started it: a driver
that is SIGKILLed, with no finally block or atexit run, still leaves nothing
behind, because the server's watchdog (helpers.server_watchdog) stops its whole group."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import helpers
from conftest import private_socket_path
from proof import program

TESTS = Path(__file__).resolve().parent


def _driver(body: str) -> subprocess.Popen:
    """A driver process: imports conftest (its environment, helpers) and runs `body`."""
    code = f"import sys\nsys.path[:0] = [{str(TESTS)!r}, {str(TESTS.parent)!r}]\n" + textwrap.dedent(body)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def _read_until(proc: subprocess.Popen, word: str) -> str:
    """The driver's stdout line starting with `word` (what follows it)."""
    for line in proc.stdout:
        if line.startswith(word):
            return line[len(word) :].strip()
    raise AssertionError(f"the driver exited with code {proc.wait()} before printing {word!r}")


def _watchdogs_of(socket_path: str) -> list[int]:
    """PIDs of live watchdogs started for this socket (they run outside the group)."""
    pids = []
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        argv = program.cmdline(pid).split(b"\0")
        if helpers.WATCHDOG_MARKER.encode() in argv and socket_path.encode() in argv:
            if helpers.start_time(pid) is not None:  # not a zombie
                pids.append(pid)
    return pids


def _gone_within(pgid: int, timeout_s: float) -> float | None:
    """Seconds until group `pgid` is empty, or None if it is not within timeout_s."""
    start = time.monotonic()
    while helpers.group_members(pgid):
        if time.monotonic() - start > timeout_s:
            return None
        time.sleep(0.1)
    return time.monotonic() - start


def _outlives_its_killed_caller(driver: subprocess.Popen, pid: str, start: str, timeout_s: float) -> bool:
    """SIGKILL the driver, and return whether process `pid`, started at `start`, still runs `timeout_s` later."""
    driver.kill()
    driver.wait()
    deadline = time.monotonic() + timeout_s
    while helpers.start_time(int(pid)) == start and time.monotonic() < deadline:
        time.sleep(0.1)
    return helpers.start_time(int(pid)) == start


def _cleanup(driver: subprocess.Popen, pgid: int | None) -> None:
    driver.kill()
    driver.wait()
    driver.stdout.close()
    if pgid is not None and helpers.group_members(pgid):
        os.killpg(pgid, signal.SIGKILL)


def test_a_sigkilled_driver_leaves_no_vllm_process_behind(tmp_path):
    """A real vLLM server on CPU (API server, engine core and its helpers):
    SIGKILL the driver once the server is healthy; the group is gone soon after."""
    sock = str(private_socket_path())
    driver = _driver(f"""
        import time
        import helpers
        from weight_sync import models
        from proof import program
        from conftest import CPU_LAUNCHER, cpu_serve_args
        from pathlib import Path
        tmp = Path({str(tmp_path)!r})
        model = models.build_preset("tiny", tmp / "tiny")
        server = helpers.start_server(
            cpu_serve_args(model, "--load-format", "dummy"), socket_path={sock!r},
            log_path=tmp / "server.log", launcher=CPU_LAUNCHER,
            env={{"PYTHONPATH": {str(TESTS.parent)!r}}},
        )
        print("pgid", server.pgid, flush=True)
        helpers.wait_until_healthy(server, timeout_s=240)
        print("healthy", flush=True)
        time.sleep(600)
    """)
    pgid = None
    try:
        pgid = int(_read_until(driver, "pgid"))
        _read_until(driver, "healthy")
        assert helpers.health(sock)
        assert len(helpers.group_members(pgid)) >= 2  # API server + engine core at least
        assert len(_watchdogs_of(sock)) == 1
        driver.kill()  # SIGKILL: no finally, no atexit
        driver.wait()
        took = _gone_within(pgid, 60)  # the watchdog's 10 s grace, then SIGKILL: a loaded machine adds more
        assert took is not None, f"processes {helpers.group_members(pgid)} of the server outlived the driver"
        print(f"server group gone {took:.1f}s after the driver's SIGKILL")
        assert not helpers.health(sock)
        deadline = time.monotonic() + 30
        while _watchdogs_of(sock) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _watchdogs_of(sock) == []
        assert (
            "[server_watchdog] the process that started the vLLM server is gone"
            in (tmp_path / "server.log").read_text()
        )
    finally:
        _cleanup(driver, pgid)


STUBBORN_SERVER = """
import signal, subprocess, sys, time
# a child that ignores SIGTERM, like a wedged engine core (saying so in the log), and
# says "ready" once its handler is in place: a SIGTERM before that would end it
subprocess.Popen([sys.executable, "-c", "import signal, time; "
    "signal.signal(signal.SIGTERM, lambda *_: print('SIGTERM ignored', flush=True)); "
    "print('ready', flush=True); time.sleep(120)"])
time.sleep(120)
"""


def _wait_for_line(path: Path, line: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while line not in (path.read_text().splitlines() if path.exists() else []):
        assert time.monotonic() < deadline, f"no line {line!r} in {path}"
        time.sleep(0.05)


def test_what_ignores_sigterm_is_sigkilled_after_the_grace(tmp_path):
    """The driver is SIGKILLed: its server's watchdog SIGTERMs the group
    (which ends the leader), and SIGKILLs what ignored it once the grace is
    over, not before. Told by the log and the group's end, not by looking at
    the group within the grace, which a busy machine can make the test miss."""
    sock = str(private_socket_path())
    log = tmp_path / "log"
    grace_s = 2.0
    driver = _driver(f"""
        import sys, time
        import helpers
        from proof import program
        helpers._WATCHDOG_GRACE_S = {grace_s}
        server = helpers.start_server(
            [], socket_path={sock!r}, log_path={str(log)!r},
            launcher=(sys.executable, "-c", {STUBBORN_SERVER!r}),
        )
        print("pgid", server.pgid, flush=True)
        time.sleep(600)
    """)
    pgid = None
    try:
        pgid = int(_read_until(driver, "pgid"))
        _wait_for_line(log, "ready")  # the stubborn child is up, its handler in place
        members = helpers.group_members(pgid)
        assert len(members) == 2 and pgid in members, members  # the leader and the stubborn child
        killed_at = time.monotonic()  # before the kill: the watchdog may act before this process runs again
        driver.kill()
        driver.wait()
        took = _gone_within(pgid, grace_s + 30)
        assert took is not None, "SIGKILL did not follow"
        assert time.monotonic() - killed_at >= grace_s - 0.5  # it waited out the grace first
        text = log.read_text()
        assert "stopping its process group" in text
        assert "SIGTERM ignored" in text.splitlines()  # SIGTERM came first, and the child outlived it
        assert _gone_within_watchdog(sock)
    finally:
        _cleanup(driver, pgid)


def _gone_within_watchdog(sock: str, timeout_s: float = 30) -> bool:
    deadline = time.monotonic() + timeout_s
    while _watchdogs_of(sock):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_stop_server_also_ends_the_watchdog(tmp_path):
    """stop_server waits for the watchdog too, and the server's Popen is the
    server itself: its exit code, its pid the group's id."""
    sock = str(private_socket_path())
    server = helpers.start_server(
        [], socket_path=sock, log_path=tmp_path / "log", launcher=(sys.executable, "-c", STUBBORN_SERVER)
    )
    try:
        deadline = time.monotonic() + 60
        while len(helpers.group_members(server.pgid)) < 2 or not _watchdogs_of(sock):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert os.getpgid(server.proc.pid) == server.pgid
        (watchdog,) = _watchdogs_of(sock)
        assert os.getpgid(watchdog) != server.pgid  # outside the group: group_members counts only the server's
        helpers.stop_server(server, grace_s=1)
        assert helpers.group_members(server.pgid) == []
        assert server.proc.returncode == -signal.SIGTERM  # the server's own status, not a wrapper's
        assert _watchdogs_of(sock) == []
        helpers.stop_server(server)  # safe to call twice
    finally:
        if helpers.group_members(server.pgid):
            os.killpg(server.pgid, signal.SIGKILL)


def test_a_server_that_fails_to_start_reports_its_own_exit_code(tmp_path):
    server = helpers.start_server(
        [],
        socket_path=private_socket_path(),
        log_path=tmp_path / "log",
        launcher=(sys.executable, "-c", "import sys; print('bad flag'); sys.exit(3)"),
    )
    try:
        helpers.wait_until_healthy(server, timeout_s=120, poll_s=0.1)  # it exits long before
    except helpers.ServerError as e:
        assert "exited with code 3" in str(e) and "bad flag" in str(e)
    else:
        raise AssertionError("no ServerError")
    finally:
        helpers.stop_server(server)
    assert (tmp_path / "log").read_text().startswith("$ " + sys.executable + " -c ")


def _ignored_signals(pid: int) -> set[int]:
    """The signals process `pid` ignores now (SigIgn in /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as f:
        mask = int(next(line for line in f if line.startswith("SigIgn:")).split()[1], 16)
    return {sig for sig in range(1, 65) if mask >> (sig - 1) & 1}


def test_sigterm_runs_the_cleanup_and_a_second_one_cannot_cut_it_short(tmp_path):
    """As the script does it (program.hangups_unwind around helpers.serving):
    SIGTERM exits with 143 through the finally blocks, which stop the
    server's whole group; a second SIGTERM during that shutdown is ignored.

    The driver's stop_server waits for the test's word before it starts: the
    second SIGTERM then surely comes during the shutdown, while the driver
    must ignore it. (Sent unchecked, a SIGTERM that cut the shutdown short
    showed only if the server outlived the driver, which exits with 143
    either way: a race between the two shutdowns.)"""
    sock = str(private_socket_path())
    go_on = tmp_path / "go-on"
    driver = _driver(f"""
        import time
        import helpers
        from weight_sync import models
        from proof import program
        from conftest import CPU_LAUNCHER, cpu_serve_args
        from pathlib import Path
        tmp = Path({str(tmp_path)!r})
        model = models.build_preset("tiny", tmp / "tiny")
        stop_server = helpers.stop_server

        def stop_when_told(server, **kwargs):
            print("stop_server called", flush=True)
            while not Path({str(go_on)!r}).exists():
                time.sleep(0.05)
            stop_server(server, **kwargs)

        helpers.stop_server = stop_when_told
        with program.hangups_unwind(), helpers.serving(
            cpu_serve_args(model, "--load-format", "dummy"), socket_path={sock!r},
            log_path=tmp / "server.log", launcher=CPU_LAUNCHER,
            env={{"PYTHONPATH": {str(TESTS.parent)!r}}},
        ) as server:
            helpers.wait_until_healthy(server, timeout_s=240)
            print("pgid", server.pgid, flush=True)
            time.sleep(600)
    """)
    pgid = None
    try:
        pgid = int(_read_until(driver, "pgid"))  # printed once healthy
        driver.send_signal(signal.SIGTERM)
        _read_until(driver, "[shutdown] stopping the vLLM server")
        _read_until(driver, "stop_server called")  # and waiting for go_on: the shutdown is under way
        assert {signal.SIGINT, signal.SIGTERM, signal.SIGHUP} <= _ignored_signals(driver.pid)
        driver.send_signal(signal.SIGTERM)  # while it stops the server
        assert helpers.health(sock)  # not stopped yet
        go_on.touch()
        assert driver.wait(timeout=120) == 128 + signal.SIGTERM  # stop_server: 20 s grace, SIGKILL, the watchdog
        assert helpers.group_members(pgid) == []  # gone before the driver exited
        assert not helpers.health(sock) and _watchdogs_of(sock) == []
    finally:
        _cleanup(driver, pgid)


def test_sigterm_still_unwinds_after_ray_starts():
    """ray.init() installs Ray's own SIGTERM handler, which prints a stack and
    aborts the process (exit 134) a few seconds into the cleanup; the script
    starts Ray through program.init_ray, after which SIGTERM unwinds with
    143 and the cleanup runs to its end. The signal comes while the driver
    waits in Ray (as ray_trainers.send_all does during a send), whose wait turns any
    exception from a signal handler but KeyboardInterrupt into exit code 1."""
    driver = _driver("""
        import time
        import ray
        from proof import program
        from weight_sync import ray_trainers

        @ray.remote
        def slow():
            time.sleep(120)

        with program.hangups_unwind():
            try:
                program.init_ray()
                ref = slow.remote()
                print("ready", flush=True)
                ray_trainers.ray_get_all([ref], also_check=lambda: None)
            finally:
                time.sleep(4)  # past the point where Ray's handler aborts
                ray.shutdown()
                print("cleanup done", flush=True)
    """)
    try:
        _read_until(driver, "ready")
        driver.send_signal(signal.SIGTERM)
        assert _read_until(driver, "cleanup done") == ""
        assert driver.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        driver.kill()


@pytest.mark.parametrize("told_later", [False, True])
def test_a_sigkilled_driver_leaves_no_ray_process_it_started(tmp_path, told_later):
    """A driver that started its own local Ray (as the script does when none
    is running) and a server under the watchdog, with Ray's processes in
    `also_stop` (as colocated_job passes them): SIGKILL the driver, and every
    one of them is gone within seconds. (Without it, Ray's dashboard and
    runtime-env agents live on for minutes, waiting on the dead GCS.) The
    same with a server started without flags before Ray placed anything,
    and told of Ray's processes later (Server.also_stop), as colocated_job
    does."""
    sock = str(private_socket_path())
    driver = _driver(f"""
        import os, sys, time
        import ray
        import helpers
        from proof import program
        from pathlib import Path
        ray.init(num_cpus=1, include_dashboard=False)
        stand_in = dict(
            socket_path={sock!r}, log_path=Path({str(tmp_path)!r}) / "server.log",
            launcher=(sys.executable, "-c", "import time; time.sleep(600)"),
        )
        if {told_later!r}:
            server = helpers.start_server(None, **stand_in)

        @ray.remote
        class Worker:
            def pid(self):
                return os.getpid()

        worker = Worker.remote()
        ray.get(worker.pid.remote())  # a worker process is up
        def agents_up(processes):  # the raylet starts its agents on its own time
            names = [program.cmdline(int(p.split(":")[0])) for p in processes]
            return all(any(agent in n for n in names) for agent in (b"DashboardAgent", b"RuntimeEnvAgent"))
        deadline = time.monotonic() + 120
        while not agents_up(ray_processes := program.descendants(os.getpid())) and time.monotonic() < deadline:
            time.sleep(0.2)
        if {told_later!r}:
            server.also_stop(ray_processes)
        else:
            server = helpers.start_server([], also_stop=ray_processes, **stand_in)
        print("pgid", server.pgid, flush=True)
        print("ray", ",".join(ray_processes), flush=True)
        time.sleep(600)
    """)
    pgid = None
    try:
        pgid = int(_read_until(driver, "pgid"))
        ray_processes = _read_until(driver, "ray").split(",")
        names = [program.cmdline(int(p.split(":")[0])) for p in ray_processes]
        assert any(b"DashboardAgent" in n for n in names) and any(b"RuntimeEnvAgent" in n for n in names), names
        driver.kill()  # SIGKILL: no finally, no atexit
        driver.wait()
        deadline = time.monotonic() + 60
        left = ray_processes
        while left and time.monotonic() < deadline:
            left = [p for p in ray_processes if helpers.start_time(int(p.split(":")[0])) == p.split(":")[1]]
            time.sleep(0.2)
        assert left == [], f"Ray processes outlived the driver: {left}"
        assert _gone_within(pgid, 60) is not None
        assert "stopping" in (tmp_path / "server.log").read_text()
    finally:
        _cleanup(driver, pgid)


def test_stopping_the_server_normally_leaves_the_callers_ray_alone(tmp_path):
    """stop_server lets the watchdog go: the processes in `also_stop` are
    killed only when the caller is gone, not on the way out of a normal run
    (ray.shutdown() stops them then)."""
    driver = _driver(f"""
        import os, sys
        import ray
        import helpers
        from proof import program
        from conftest import private_socket_path
        from pathlib import Path
        ray.init(num_cpus=1, include_dashboard=False)
        ray_processes = program.descendants(os.getpid())
        server = helpers.start_server(
            [], socket_path=private_socket_path(), log_path=Path({str(tmp_path)!r}) / "server.log",
            launcher=(sys.executable, "-c", "import time; time.sleep(600)"), also_stop=ray_processes,
        )
        helpers.stop_server(server)
        alive = [p for p in ray_processes if helpers.start_time(int(p.split(":")[0])) == p.split(":")[1]]
        print("alive", len(alive), len(ray_processes), flush=True)
        ray.shutdown()
    """)
    try:
        alive, listed = map(int, _read_until(driver, "alive").split())
        assert listed >= 3 and alive == listed
        assert driver.wait(timeout=60) == 0
    finally:
        _cleanup(driver, None)


def test_what_else_the_caller_started_goes_even_after_the_server_is_gone(tmp_path):
    """The server exits on its own first (a crash), the caller is SIGKILLed
    later: the watchdog still stops what the caller listed in `also_stop`."""
    driver = _driver(f"""
        import os, signal, subprocess, sys, time
        import helpers
        from proof import program
        from conftest import private_socket_path
        from pathlib import Path
        other = subprocess.Popen(["sleep", "300"])  # stands in for Ray's processes
        server = helpers.start_server(
            [], socket_path=private_socket_path(), log_path=Path({str(tmp_path)!r}) / "server.log",
            launcher=(sys.executable, "-c", "import time; time.sleep(600)"),
            also_stop=program.descendants(os.getpid(), "sleep"),
        )
        # The watchdog leaves the server's group before the server execs its
        # command: killing the group sooner would kill the watchdog with it.
        while helpers.WATCHDOG_MARKER.encode() in program.cmdline(server.proc.pid).split(b"\\0"):
            time.sleep(0.05)
        os.killpg(server.pgid, signal.SIGKILL)  # the server dies first
        server.proc.wait()
        time.sleep(1)
        print("other", other.pid, helpers.start_time(other.pid), flush=True)
        time.sleep(600)
    """)
    try:
        pid, start = _read_until(driver, "other").split()
        assert not _outlives_its_killed_caller(driver, pid, start, timeout_s=10), (
            "the listed process outlived the caller"
        )
    finally:
        _cleanup(driver, None)


def test_the_watchdog_takes_a_list_of_processes_of_any_length(tmp_path):
    """A host where Ray runs hundreds of processes: Server.also_stop hands the watchdog 1,000 of them, 21 KB on
    one line, which reaches it over several reads; the one listed last is still killed with the caller."""
    driver = _driver(f"""
        import subprocess, sys, time
        import helpers
        from conftest import private_socket_path
        from pathlib import Path
        other = subprocess.Popen(["sleep", "300"], stdout=subprocess.DEVNULL)  # the last of Ray's processes
        server = helpers.start_server(
            [], socket_path=private_socket_path(), log_path=Path({str(tmp_path)!r}) / "server.log",
            launcher=(sys.executable, "-c", "import time; time.sleep(600)"),
        )
        # PIDs above any kernel's limit (4,194,304) stand in for the others: none of them can be killed.
        listed = [f"{{9_000_000 + i}}:{{10**11 + i}}" for i in range(999)] + [f"{{other.pid}}:{{helpers.start_time(other.pid)}}"]
        assert len(listed) == 1000 and len(",".join(listed)) > 20_000
        server.also_stop(listed)
        print("other", other.pid, helpers.start_time(other.pid), flush=True)
        time.sleep(600)
    """)
    pid = start = None
    try:
        pid, start = _read_until(driver, "other").split()
        assert not _outlives_its_killed_caller(driver, pid, start, timeout_s=30), "the last one outlived the caller"
        assert "stopping 1000 other processes" in (tmp_path / "server.log").read_text()
    finally:
        _cleanup(driver, None)
        if pid is not None and helpers.start_time(int(pid)) == start:
            os.kill(int(pid), signal.SIGKILL)


def test_also_stop_on_a_server_that_exited_reports_the_servers_error(tmp_path):
    """The server failed to start before the caller listed Ray's processes: the caller learns why it exited,
    as wait_until_healthy would say it, not that the watchdog's pipe is closed."""
    sock = str(private_socket_path())
    server = helpers.start_server(
        [],
        socket_path=sock,
        log_path=tmp_path / "log",
        launcher=(sys.executable, "-c", "import sys; print('ValueError: no such model'); sys.exit(3)"),
    )
    try:
        server.proc.wait(timeout=60)
        # The watchdog goes once the server's group is empty. Waited for until it is a zombie, when every file it
        # held is closed: the kernel may close its end of `done` a moment before its end of `alive`.
        assert _gone_within_watchdog(sock, timeout_s=60)
        with pytest.raises(helpers.ServerError) as err:
            server.also_stop(["1:1"])
        assert str(err.value).startswith("vLLM server exited with code 3 during start")
        assert "ValueError: no such model" in str(err.value)
    finally:
        helpers.stop_server(server)


def test_descendants_can_keep_to_what_was_started_from_one_place():
    """colocated_job lists only the processes of the Ray it started (their
    command lines run from Ray's package), not every child of its process."""
    import ray

    unrelated = subprocess.Popen(["sleep", "30"])
    try:
        listed = [int(p.split(":")[0]) for p in program.descendants(os.getpid())]
        assert unrelated.pid in listed
        ray_only = [int(p.split(":")[0]) for p in program.descendants(os.getpid(), os.path.dirname(ray.__file__))]
        assert unrelated.pid not in ray_only
    finally:
        unrelated.kill()
        unrelated.wait()
