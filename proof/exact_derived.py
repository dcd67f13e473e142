# SPDX-License-Identifier: Apache-2.0
"""Check the parameters vLLM derives after loading, which no tensor the trainer sends writes.

Attention layers such as MLA's compute some of their parameters from others after a load: W_UK_T and W_UV
from kv_b_proj's weight. `derived_parameters` names them, and exact_problems in exact_check_engine.py expects
no sent tensor in them. ExactCheckWorker checks them after each sync: `derived_views` finds those that are
views into a parameter compared bit for bit, and `derived_problems` derives each other one again from what
the engine holds and names any that differ.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from weight_sync.vllm_adapter import attention_post_load_hook, internal


def derived_parameters(model: torch.nn.Module) -> list[str]:
    """Return the parameters no sent tensor writes, which vLLM computes from others after loading.

    These belong to attention layers that process their weights after the load, such as MLA's absorbed
    W_UK_T and W_UV derived from kv_b_proj. direct_load_finish runs that processing, as vLLM's loader does.
    The exact check proves their sources; each is a view into one of those (derived_views), or else
    derived_problems derives it again from them.
    """
    is_deferred_attention_layer = internal("vllm.model_executor.layers.attention", "is_deferred_attention_layer")

    return [
        f"{prefix}.{name}"
        for prefix, module in model.named_modules()
        if is_deferred_attention_layer(module)
        for name, _ in module.named_parameters(recurse=False)
    ]


def owns_any(layer: torch.nn.Module, prefix: str, names: set[str]) -> bool:
    """Say whether `layer` (named `prefix`) holds, as its own, any of the parameters `names`."""
    return any(f"{prefix}.{n}" in names for n, _ in layer.named_parameters(recurse=False))


def derived_views(model: torch.nn.Module, derived: set[str], compared: set[str]) -> dict[str, str]:
    """Return each derived parameter that is a view into a compared parameter's memory, with that one's name.

    vLLM keeps MLA's W_UK_T and W_UV as views of kv_b_proj's weight where their dtypes match: their bits are
    that weight's, compared bit for bit, and nothing is derived again. A derived parameter with memory of its
    own, as after a load that gave kv_b_proj new storage, is not a view, and is derived again."""
    params = dict(model.named_parameters())
    by_storage: dict[int, list[str]] = defaultdict(list)
    for name in compared:
        if name in params and params[name].numel():
            by_storage[params[name].untyped_storage().data_ptr()].append(name)
    views = {}
    for name in sorted(derived):
        param = params[name]
        candidates = by_storage.get(param.untyped_storage().data_ptr(), []) if param.numel() else []
        if within := [c for c in sorted(candidates) if _within(_span(param), _span(params[c]))]:
            views[name] = within[0]
    return views


def _span(t: torch.Tensor) -> tuple[int, int]:
    """Return the first and one past the last byte address a tensor's elements occupy."""
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _within(inner: tuple[int, int], outer: tuple[int, int]) -> bool:
    return outer[0] <= inner[0] and inner[1] <= outer[1]


def derived_problems(layers: list[tuple[str, torch.nn.Module]], vllm_config, names: set[str]) -> list[str]:
    """Derive the parameters in `names` again from what this engine holds now; name each that differs.

    `layers` holds (name, layer) of the attention layers that own them. Each runs its own post-load hook
    again, as vLLM does after a load, and each such parameter must come out bit for bit as it was: a sync
    whose post-load processing did not run, or ran before its sources were written, left it derived from
    other weights. A parameter that differs is put back as it was, and each is kept in its own storage, so
    the check changes nothing the engine serves with. A parameter in `names` that no layer derives again is
    named too.
    """
    is_deferred = internal("vllm.model_executor.layers.attention", "is_deferred_attention_layer")
    set_current_vllm_config = internal("vllm.config", "set_current_vllm_config")
    problems, derived_again = [], set()
    with torch.no_grad(), set_current_vllm_config(vllm_config):
        for prefix, layer in layers:
            own = {n: p for n, p in layer.named_parameters(recurse=False) if f"{prefix}.{n}" in names}
            if not own or not is_deferred(layer):
                continue
            held = {n: (p.data, p.detach().clone()) for n, p in own.items()}  # (its storage, its values)
            attention_post_load_hook(layer, vllm_config.model_config)()
            for n, param in layer.named_parameters(recurse=False):
                if n in held:
                    storage, before = held[n]
                    same = _same_bits(param.detach(), before)
                    param.data = storage
                    if not same:
                        problems.append(f"{prefix}.{n}: not what vLLM derives from the weights held")
                        storage.copy_(before)
                    derived_again.add(f"{prefix}.{n}")
    return problems + [
        f"{n}: derived by vLLM after loading, and no layer here derives it again" for n in sorted(names - derived_again)
    ]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Return whether `a` and `b` hold the same bits in the same shape and dtype (NaNs and signed zeros included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
