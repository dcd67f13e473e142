# SPDX-License-Identifier: Apache-2.0
"""A CPU server's engine whose vLLM lacks one of vllm_adapter's INTERNALS, for tests/test_fallback.py:
ExactCheckWorker with two more calls, `take_away(module, name)`, which removes that name in the engine's
process, or gives it another signature if INTERNALS names the parameters it must take, and `put_back()`.

The name goes once vLLM has started and stays gone until put back: vLLM's own modules imported it at their
start, as a vLLM that lacks it would have its own equivalent, so only this project's code finds it missing."""

import importlib

from proof.exact_check_engine import ExactCheckWorker
from weight_sync import vllm_adapter


def _of_another_signature(other, arguments):
    raise AssertionError("a vLLM internal of another signature was called")


def needed(entry: vllm_adapter.Internal, by: str) -> bool:
    """Whether the default run (bf16, on the installed vLLM) needs `entry` for `by`, a use in its needed_by."""
    import vllm
    from packaging.version import Version

    installed = Version(Version(vllm.__version__).base_version)
    return (
        by in entry.needed_by
        and not entry.fp8_only
        and (entry.needed_from is None or installed >= Version(entry.needed_from))
    )


def _no_such(module: str, name: str):
    raise AttributeError(f"module {module!r} has no attribute {name!r}")


def take_away(module: str, name: str):
    """Remove INTERNALS' `module.name` in this process, or give it another signature if the entry lists the
    parameters it must take; return a function that puts it back."""
    entry = next(i for i in vllm_adapter.INTERNALS if (i.module, i.name) == (module, name))
    owner = importlib.import_module(module)
    *path, leaf = name.split(".")
    for part in path:
        owner = getattr(owner, part)
    had = vars(owner).get(leaf)  # as defined, so that a method or function goes back exactly as it was
    lazily = vars(owner).get("__getattr__") if had is None and not path else None
    if lazily is not None and hasattr(owner, leaf):  # a module that makes the name when asked for it
        owner.__getattr__ = lambda asked: _no_such(module, asked) if asked == leaf else lazily(asked)
        return lambda: setattr(owner, "__getattr__", lazily)
    if entry.parameters:
        setattr(owner, leaf, _of_another_signature)
    elif had is not None:
        delattr(owner, leaf)

    def put_back() -> None:
        if had is None:
            delattr(owner, leaf)
        else:
            setattr(owner, leaf, had)

    return put_back


class LackingWorker(ExactCheckWorker):
    def take_away(self, module: str, name: str) -> str:
        self._put_back = [*getattr(self, "_put_back", []), (f"{module}.{name}", take_away(module, name))]
        return f"{module}.{name}"

    def put_back(self) -> list[str]:
        """Put back every name taken away, and return them."""
        put_back, self._put_back = getattr(self, "_put_back", []), []
        for _, undo in reversed(put_back):
            undo()
        return [name for name, _ in put_back]
