# SPDX-License-Identifier: Apache-2.0
"""Make the example a command-line program; none of this is needed to copy the sync.

`hangups_unwind` makes SIGTERM and SIGHUP unwind like Ctrl-C, through every `finally`, because Ray's own
handlers would cut the cleanup short. `cli` turns the expected failures into one `error:` line and an exit
code. `init_ray` starts Ray with the driver's settings. `descendants` uses psutil to list the processes of a
local Ray, for the server's watchdog to stop together with the server.
"""

from __future__ import annotations

import os
import signal
import sys
from contextlib import contextmanager

import psutil
import ray

from helpers import ServerError, start_time
from weight_sync.multinode import job_env
from weight_sync.ray_trainers import PlacementError, TrainerDied


def cli(main_fn) -> None:
    """Run main_fn() and exit with its code.

    Expected failures, such as a dead rank or server or no room for the trainers, exit with one `error:`
    line. Ctrl-C also exits with one line, after the cleanup has run on the way out. Anything else keeps its
    traceback.
    """
    try:
        sys.exit(main_fn())
    except (PlacementError, TrainerDied, ServerError) as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        print("error: interrupted; the server and the trainers are stopped", file=sys.stderr)
        sys.exit(130)


@contextmanager
def hangups_unwind():
    """Make SIGTERM and SIGHUP end the program the way Ctrl-C does, inside this block.

    These signals come from a scheduler's stop or a closed terminal. They raise an exception that runs every
    `finally` on the way out, and so stops the server; leaving this block, it becomes SystemExit(128 + signal).
    The exception, Hangup, is a KeyboardInterrupt because a blocking Ray call such as ray.wait or ray.get
    gives way only to that: it turns any other exception raised in a signal handler into an exit with code 1.
    """
    _hangups_received.clear()
    previous = unwind_on_hangups()
    try:
        yield
    except KeyboardInterrupt:  # Ray may raise its own KeyboardInterrupt in place of ours.
        if _hangups_received:
            raise SystemExit(128 + _hangups_received[0]) from None
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class Hangup(KeyboardInterrupt):
    """Raised for SIGTERM or SIGHUP inside hangups_unwind."""


_hangups_received: list[int] = []


def unwind_on_hangups() -> dict:
    """Install hangups_unwind's signal handlers and return the ones they replace.

    Call it again after a library installs its own. ray.init() installs Ray's, under which a SIGTERM during a
    blocking Ray call aborts the process, or ends it with code 1, midway through the cleanup.
    """
    return {sig: signal.signal(sig, _unwind) for sig in (signal.SIGTERM, signal.SIGHUP)}


def _unwind(signum: int, _frame) -> None:
    _hangups_received.append(signum)
    raise Hangup(f"signal {signum}")


def init_ray() -> None:
    """Start Ray for the job, then reinstall the hangup handlers.

    It joins a running cluster if there is one, found through RAY_ADDRESS or `ray start`, and otherwise starts
    a local Ray. Every node's processes get the driver's settings from job_env. unwind_on_hangups then runs
    again, because Ray's own handler would abort the cleanup.
    """
    ray.init(include_dashboard=False, runtime_env={"env_vars": job_env()})
    unwind_on_hangups()


def descendants(pid: int, started_from: str | None = None) -> list[str]:
    """Return "PID:START" for each live descendant of process `pid`, for start_server's `also_stop`.

    START is the process's start time as the watchdog reads it with helpers.start_time. If `started_from`,
    a directory, is given, only the children whose command line runs something in it are kept, with all their
    descendants; for example, the processes of a local Ray cluster that `pid` started, and no others.
    """
    try:
        children = psutil.Process(pid).children()
    except psutil.Error:  # The process is gone.
        return []
    found = []
    for child in children:
        if started_from is not None and started_from.encode() not in cmdline(child.pid):
            continue
        try:
            tree = [child, *child.children(recursive=True)]
        except psutil.Error:  # The child ended meanwhile.
            tree = [child]
        found += [f"{p.pid}:{start}" for p in tree if (start := start_time(p.pid)) is not None]
    return found


def cmdline(pid: int) -> bytes:
    """Return process `pid`'s arguments, NUL-separated, or b"" if it is gone or a zombie."""
    try:
        return os.fsencode("\0".join(psutil.Process(pid).cmdline()))
    except psutil.Error:
        return b""
