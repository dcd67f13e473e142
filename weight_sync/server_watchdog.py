"""Start the vLLM server so that it cannot outlive the process that started it
(helpers.start_server runs this; it is not meant to be run by hand).

    python server_watchdog.py ALIVE_FD DONE_FD GRACE_S [ALSO] -- CMD [ARGS...]

This process is the leader of the server's new process group (the caller
starts it with start_new_session=True). It forks off a watchdog into a
session of its own, outside the server's group, then execs CMD: the server
keeps this process's PID, so the caller's Popen is the server itself (its
pid is the group's id, poll() its exit code) and the group holds only the
server's own processes.

The watchdog holds the read end of a pipe (ALIVE_FD) whose write end only the
caller holds. It reads EOF once the caller is gone, however it ended (SIGKILL
included), or when stop_server closes it after stopping the group itself.
Then it SIGTERMs the whole group, SIGKILLs what is left after GRACE_S, and
exits once no process of the group is left, as it also does when the group
empties on its own. Its exit closes DONE_FD, which only it holds: the caller
reads EOF there once the watchdog is gone.

ALSO ("PID:START,PID:START,...", optional) names other processes the caller
started that must not outlive it either, e.g. the local Ray cluster a script
started (Ray's agents outlive a SIGKILLed driver by minutes, waiting on its
dead GCS). They are SIGKILLed only if the caller itself is gone, not when
stop_server lets the watchdog go (it writes "r" before closing ALIVE_FD);
START (the process's start time in /proc) keeps a reused PID safe.

Standard library only: it starts fast and holds next to no memory.
"""

import os
import select
import signal
import sys
import time


def proc_stat(pid: int | str) -> list[bytes] | None:
    """The fields of /proc/PID/stat after the process name (state, ppid,
    pgrp, ...; start time is [19]), None if the process is gone. Bytes: a
    process name need not be UTF-8. (helpers and the tests use it too.)"""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def group_members(pgid: int) -> list[int]:
    """PIDs alive in process group `pgid` (Linux /proc), zombies excluded."""
    return [
        int(entry)
        for entry in filter(str.isdigit, os.listdir("/proc"))
        if (stat := proc_stat(entry)) is not None and stat[0] != b"Z" and int(stat[2]) == pgid
    ]


def start_time(pid: int) -> str | None:
    """Process `pid`'s start time (clock ticks after boot), None if it is gone or a zombie."""
    stat = proc_stat(pid)
    return None if stat is None or stat[0] == b"Z" else stat[19].decode()


def _say(text: str) -> None:
    try:
        os.write(2, f"[server_watchdog] {text}\n".encode())
    except OSError:
        pass


def _wait_gone(pgid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while group_members(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _kill_listed(processes: list[str]) -> None:
    """SIGKILL each "PID:START" that is still that same process."""
    for entry in processes:
        pid, start = entry.split(":")
        if start_time(int(pid)) == start:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


def _stop_group(pgid: int, grace_s: float) -> None:
    if not group_members(pgid):
        return
    _say(f"the process that started the vLLM server is gone: stopping its process group {pgid}")
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        if _wait_gone(pgid, wait_s):
            return
    _say(f"processes {group_members(pgid)} of group {pgid} survived SIGKILL")


def _watch(pgid: int, alive_fd: int, leader_fd: int | None, grace_s: float, also: list[str]) -> None:
    """Until the caller is gone (EOF on alive_fd) or the group is empty."""
    leader_alive, released = True, False
    while True:
        # While the leader runs, block on its pidfd; after that (its engines
        # may live on), look at the group once a second.
        waiting = [alive_fd] + ([leader_fd] if leader_alive and leader_fd is not None else [])
        timeout = None if (leader_alive and leader_fd is not None) or also else 1.0
        try:
            ready, _, _ = select.select(waiting, [], [], timeout)
        except InterruptedError:
            continue
        if alive_fd in ready:
            try:
                data = os.read(alive_fd, 4096)
            except OSError:
                data = b""
            released = released or b"r" in data  # stop_server says so before it lets go
            if not data:  # EOF: the caller is gone, or stop_server let go
                _stop_group(pgid, grace_s)
                if also and not released:  # the caller is gone: what else it started goes too
                    _say(f"stopping {len(also)} other processes the caller started")
                    _kill_listed(also)
                return
        if leader_fd is not None and leader_fd in ready:
            leader_alive = False
        # An empty group ends the watch, unless other processes are in our care:
        # then only the caller's release or death does.
        if (not leader_alive or leader_fd is None) and not also and not group_members(pgid):
            return


def main() -> None:
    alive_fd, done_fd, grace_s = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    rest = sys.argv[4:]
    also = rest.pop(0).split(",") if rest and rest[0] != "--" else []
    if not rest or rest[0] != "--" or len(rest) < 2:
        sys.exit("usage: server_watchdog.py ALIVE_FD DONE_FD GRACE_S [PID:START,...] -- CMD [ARGS...]")
    cmd = rest[1:]
    leader = os.getpid()
    try:
        leader_fd = os.pidfd_open(leader)  # readable once the server exits (Linux 5.3+)
    except (AttributeError, OSError):
        leader_fd = None

    child = os.fork()
    if child == 0:
        # The watchdog, twice forked: a session and group of its own, so the
        # server's group holds only the server's processes and signals to it
        # never reach here; not a child of the server, which would not reap it.
        try:
            os.setsid()
            if os.fork() != 0:
                os._exit(0)
            for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
                signal.signal(sig, signal.SIG_IGN)
            fd = os.open(os.devnull, os.O_RDONLY)
            os.dup2(fd, 0)
            os.close(fd)
            _watch(leader, alive_fd, leader_fd, grace_s, also)
        except BaseException as e:  # noqa: BLE001 - say it in the server's log, whatever it was
            _say(f"failed: {e!r}")
            os._exit(1)
        os._exit(0)  # closes done_fd: the caller sees the watchdog gone

    # The server: wait until the watchdog is out of the group, let go of its
    # ends of the pipes, and become the server.
    os.waitpid(child, 0)
    for fd in (alive_fd, done_fd, leader_fd):
        if fd is not None:
            os.close(fd)
    try:
        os.execvp(cmd[0], cmd)
    except OSError as e:
        _say(f"cannot run {cmd[0]}: {e}")
        os._exit(127)


if __name__ == "__main__":
    main()
