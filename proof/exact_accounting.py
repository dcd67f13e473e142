# SPDX-License-Identifier: Apache-2.0
"""Account, on one engine, for every tensor the trainer sends, and sort the engine's parameters by how they are compared.

The exact check compares each vLLM parameter with the tensors written into it, so it cannot see a sent tensor
that lands nowhere, or a cast that drops bits before the comparison. `unaccounted` names those, once per
transfer, at exact_check_prepare: a tensor written into no parameter here, except an expert the trainer's own
layout puts on another engine; one written into another decoder layer's parameter, or elsewhere than into the
parameter of its own name and shape where vLLM has one; an expert vLLM's map places otherwise than the trainer's
layout; a cast that loses bits. `comparisons` says for each parameter whether it is compared bit for bit,
element by element in its place, or not, and why, so the verdict counts only what it compared.
"""

from __future__ import annotations

import re

import torch

# Why a parameter is not compared bit for bit in its place, by the key the JSON's `not_compared` uses.
NOT_COMPARED = {
    "by_value": "laid out by vLLM its own way, compared by value only",
    "fp8_requantized": "FP8 experts re-quantized by vLLM's loader",
}

# One expert's tensor as vLLM's own loader takes it: `<layer>.experts.<id>.<name>`.
_ONE_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")  # A decoder layer's index in a tensor's or a parameter's name.


def unaccounted(
    model: torch.nn.Module,
    sent: list,
    targets: list[list[str]],
    casts: dict[int, str],
    trainer_rank: int | None,
    holders: dict[int, int],
    not_probed: tuple[str, ...] = (),
) -> tuple[list[str], list[str]]:
    """Return (problems naming each sent tensor this engine cannot account for, the casts it accepts).

    `sent` and `targets` are exact_targets' argument and answer, `casts` its casts. `holders` is the trainer's
    own layout: {sent index: the trainer rank whose GPU's engine alone holds that expert}; any other tensor
    every engine holds. `trainer_rank` is the rank on this engine's GPU, or None if unknown, which takes every
    tensor as held here. Tensors of the FP8 expert layers in `not_probed`, whose parameters are counted as not
    compared, are left out. A cast is accepted only if it keeps every bit of every value, such as bfloat16
    held as float32, or is the FP8 quantization --rollout-dtype fp8 asks for; accepted ones are listed.
    """
    from weight_sync.direct_load import _expert_layers, local_expert_ids

    params = dict(model.named_parameters())
    layers = _expert_layers(model)
    problems, accepted = [], []
    for index, ((name, dtype, shape, block), names) in enumerate(zip(sent, targets, strict=True)):
        if not block and not_probed and name.startswith(not_probed):
            continue
        expert = None if block else _ONE_EXPERT.match(name)
        here = trainer_rank is None or holders.get(index, trainer_rank) == trainer_rank
        if expert and expert[1] in layers:
            held_here = int(expert[2]) in local_expert_ids(layers[expert[1]])
            if held_here != here:
                owner = "this engine's" if here else f"trainer rank {holders[index]}'s"
                problems.append(
                    f"{name}: the trainer's layout puts expert {expert[2]} on {owner} GPU, vLLM's expert map "
                    f"{'here' if held_here else 'on another engine'}"
                )
                continue
        if not here:
            continue
        if not names:
            problems.append(f"{name}: the trainer sent it, and vLLM wrote it into no parameter")
        problems += [f"{name}: written into {n}, which is no vLLM parameter" for n in names if n not in params]
        layer = _LAYER.search(name)
        elsewhere = [
            f"{name}: written into {n}, a parameter of another layer"
            for n in names
            if layer and (other := _LAYER.search(n)) and other[1] != layer[1]
        ]
        # Where vLLM holds a parameter of the tensor's own name and shape, that is where the tensor belongs: a
        # loader writing it elsewhere, such as into a same-shaped neighbour in its layer, swaps the two.
        own = params.get(name)
        if not elsewhere and names and own is not None and list(own.shape) == list(shape) and name not in names:
            elsewhere.append(f"{name}: written into {', '.join(names)}, not into vLLM's parameter of its own name")
        problems += elsewhere
        held = casts.get(index)
        if held and held.startswith("fp8_blocks:"):
            accepted.append(f"{name}: {dtype} sent, FP8 held, as --rollout-dtype fp8 asks")
        elif held and _keeps_every_bit(dtype, held):
            accepted.append(f"{name}: {dtype} sent, {held} held")
        elif held:
            problems.append(f"{name}: {dtype} sent, held as {held}, which loses bits")
    return problems, accepted


def _keeps_every_bit(sent: str, held: str) -> bool:
    """Return whether every value of dtype `sent` is exactly a value of dtype `held`, as bfloat16 is of float32."""
    a, b = getattr(torch, sent, None), getattr(torch, held, None)
    if not isinstance(a, torch.dtype) or not isinstance(b, torch.dtype) or a.is_floating_point != b.is_floating_point:
        return False
    return torch.promote_types(a, b) == b


def comparisons(
    model: torch.nn.Module, targets: list[list[str]], in_place, values_only, fp8_requantized, derived
) -> dict[str, list[str]]:
    """Sort the model's parameters by how the exact check compares them.

    "bit_for_bit" are compared with what the trainer sent on all three sums, element by element in their
    place: `in_place` less `values_only`. "derived" are those no sent tensor writes, which vLLM derives from
    others after loading; each is a view into a parameter compared bit for bit, or is compared bit for bit with
    what vLLM derives again from what the engine holds (exact_derived.derived_views, derived_problems).
    The others are sorted by NOT_COMPARED's keys: written but compared on fewer sums ("by_value"), and FP8
    layers that vLLM's loader quantizes ("fp8_requantized"). A parameter in none is one exact_problems names as
    written by nothing.
    """
    written = {n for names in targets for n in names}
    exact = set(in_place) - set(values_only)
    out: dict[str, list[str]] = {"bit_for_bit": [], "derived": [], **{key: [] for key in NOT_COMPARED}}
    for name, _ in model.named_parameters():
        if name in fp8_requantized:
            out["fp8_requantized"].append(name)
        elif name in written:
            out["bit_for_bit" if name in exact else "by_value"].append(name)
        elif name in derived:
            out["derived"].append(name)
    return out


def expert_holders(names: list[str], own: list[list[int]]) -> dict[int, int]:
    """Return {sent index: the trainer rank that holds that expert}, for the one-expert tensors in `names`.

    `own` is each rank's RankMeasurement.own_experts. An expert tensor no rank reports is placed as FSDP2
    shards a fused expert tensor: dim 0 cut as torch.chunk cuts it, one piece per rank.
    """
    holders = {index: rank for rank, indices in enumerate(own) for index in indices}
    experts: dict[str, int] = {}
    for name in names:
        if found := _ONE_EXPERT.match(name):
            experts[found[1]] = max(experts.get(found[1], 0), int(found[2]) + 1)
    for index, name in enumerate(names):
        if index not in holders and (found := _ONE_EXPERT.match(name)):
            holders[index] = int(found[2]) // -(-experts[found[1]] // len(own))
    return holders
