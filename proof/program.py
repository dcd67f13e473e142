# SPDX-License-Identifier: Apache-2.0
"""What makes the example a command-line program, around the sync (not part
of the lift): SIGTERM and SIGHUP unwind like Ctrl-C, through every `finally`
(`hangups_unwind`; Ray's own handlers would cut the cleanup short), the
expected failures as one `error:` line and an exit code (`cli`), Ray started
with the driver's settings (`init_ray`), and the processes of a local Ray,
for the server's watchdog to stop with the server (`descendants`, through psutil).
"""

from __future__ import annotations

import os
import signal
import sys
from contextlib import contextmanager

import psutil
import ray

from helpers import PlacementError, ServerError, TrainerDied, start_time
from weight_sync.multinode import job_env


def cli(main_fn) -> None:
    """Run main_fn() and exit with its code; the failures we expect (a dead
    rank or server, no room for the trainers) as one `error:` line, Ctrl-C as
    one line too (the cleanup has run on the way out). Anything else keeps its
    traceback."""
    try:
        sys.exit(main_fn())
    except (PlacementError, TrainerDied, ServerError) as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        print("error: interrupted; the server and the trainers are stopped", file=sys.stderr)
        sys.exit(130)


@contextmanager
def hangups_unwind():
    """SIGTERM and SIGHUP (a scheduler's stop, a closed terminal) end the
    program the way Ctrl-C does: by an exception that runs every `finally`
    (and so stops the server) on the way out; out of this block it becomes
    SystemExit(128 + signal). The exception is a KeyboardInterrupt (Hangup),
    because a blocking Ray call (ray.wait, ray.get) gives way to that one
    alone: it turns any other exception raised in a signal handler into an
    exit with code 1."""
    _hangups_received.clear()
    previous = unwind_on_hangups()
    try:
        yield
    except KeyboardInterrupt:  # (Ray raises its own KeyboardInterrupt in place of ours)
        if _hangups_received:
            raise SystemExit(128 + _hangups_received[0]) from None
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class Hangup(KeyboardInterrupt):
    """SIGTERM or SIGHUP received inside hangups_unwind."""


_hangups_received: list[int] = []


def unwind_on_hangups() -> dict:
    """hangups_unwind's handlers, (re)installed; returns the ones they replace.
    Again after a library that installs its own: ray.init() puts in Ray's,
    under which a SIGTERM during a blocking Ray call aborts the process, or
    ends it with code 1, midway through the cleanup."""
    return {sig: signal.signal(sig, _unwind) for sig in (signal.SIGTERM, signal.SIGHUP)}


def _unwind(signum: int, _frame) -> None:
    _hangups_received.append(signum)
    raise Hangup(f"signal {signum}")


def init_ray() -> None:
    """ray.init() for the job: a running cluster if there is one (RAY_ADDRESS,
    `ray start`), else a local Ray; every node's processes get the driver's
    settings (job_env). Then SIGTERM and SIGHUP unwind again
    (unwind_on_hangups): Ray's own handler would abort the cleanup."""
    ray.init(include_dashboard=False, runtime_env={"env_vars": job_env()})
    unwind_on_hangups()


def descendants(pid: int, started_from: str | None = None) -> list[str]:
    """ "PID:START" of the live descendants of process `pid`, for start_server's
    `also_stop` (START: its start time as the watchdog reads it, helpers.start_time).
    With `started_from` (a directory), only the children whose command line
    runs something in it, and all theirs: e.g. the processes of a local Ray
    cluster `pid` started, and no others."""
    try:
        children = psutil.Process(pid).children()
    except psutil.Error:  # gone
        return []
    found = []
    for child in children:
        if started_from is not None and started_from.encode() not in cmdline(child.pid):
            continue
        try:
            tree = [child, *child.children(recursive=True)]
        except psutil.Error:  # it ended meanwhile
            tree = [child]
        found += [f"{p.pid}:{start}" for p in tree if (start := start_time(p.pid)) is not None]
    return found


def cmdline(pid: int) -> bytes:
    """Process `pid`'s arguments, NUL-separated; b"" if it is gone (or a zombie)."""
    try:
        return os.fsencode("\0".join(psutil.Process(pid).cmdline()))
    except psutil.Error:
        return b""
