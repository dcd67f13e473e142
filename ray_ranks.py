"""Calling the trainer ranks through Ray, and what goes wrong there.

Every rank of rlhf_ipc_fsdp_ep.py's trainer takes part in collectives, so a
call is made on all of them at once and must not wait on a rank that is gone:

  ray_get_all   every rank's result, failing at the first error (a dead rank
                as TrainerDied, naming why; a server error as itself)
  send_all      one weight sync on every rank, sent again when the server
                failed it part way (--send-retries)
  cli           a program's failures as one `error:` line, not a traceback
"""

from __future__ import annotations

import sys

import ray

import helpers


class PlacementError(RuntimeError):
    """Ray cannot give every trainer rank its GPU on one node."""


class TrainerDied(RuntimeError):
    """A trainer rank's process died (killed, out of memory, crashed)."""


def ray_get_all(refs: list):
    """ray.get(refs), but raise as soon as any one fails: the others may be
    blocked in a collective waiting for it. A rank's ServerError (the server
    refused or died) is raised as itself, a dead rank as TrainerDied."""
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(done[0])
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, helpers.ServerError):
                raise helpers.ServerError(f"a trainer rank: {e.cause}") from None
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
