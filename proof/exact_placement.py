# SPDX-License-Identifier: Apache-2.0
"""Find where each tensor the trainer sends lands in an engine's vLLM parameters.

ExactCheckWorker.exact_check_prepare in exact_check_engine.py calls this before the syncs it checks.
`exact_targets` loads each sent tensor as a constant of its own through the model's own `load_weights` and
names the parameters it is written into; `piece_rows` reads those constants back to learn at which rows each
piece of a parameter written from several tensors lands. The FP8 expert layers that vLLM's own loader
quantizes are not probed (`fp8_layers_by_vllms_loader`). The exact check compares each parameter with the
tensors written into it, at those rows.
"""

from __future__ import annotations

import math
import re

import torch

from proof.fingerprint import FINGERPRINT_CHUNK, columns_of
from weight_sync.direct_load import EXPERT_TENSORS, _expert_layers, fp8_scales, local_expert_ids
from weight_sync.fp8_experts import fp8_shards
from weight_sync.vllm_adapter import internal

_ONE_EXPERT = re.compile(r"\.experts\.(\d+)\.")  # Captures the expert id of one expert's checkpoint tensor.

# exact_targets' cast for an expert block that vLLM holds in FP8: "fp8_blocks:<shards>".
FP8_BLOCKS = "fp8_blocks:"


def exact_targets(
    model: torch.nn.Module, sent: list, vllm_config
) -> tuple[list[list[str]], dict[int, str], list[str], list[str]]:
    """Find the parameters of `model` that each sent tensor is written into, and how to compare them.

    `sent` lists [name, dtype, shape, is a direct-loader expert block] in send order. Each tensor is loaded
    once as its own constant through the model's own `load_weights`, so whatever the model family stacks or
    renames is followed; piece_rows then reads the constants back. An expert block maps to its layer's fused
    parameter. A tensor of an expert that another engine holds is written nowhere here.

    Return four things: the targets per sent tensor; {index: dtype} of the tensors vLLM holds in another
    dtype than they are sent in, such as a router kept in fp32, which the trainer fingerprints after the same
    cast vLLM's loader makes; the parameters to compare by value alone, from _relaid_out; and the parameters
    written whole from one tensor of their shape, compared element by element.
    """
    set_current_vllm_config = internal("vllm.config", "set_current_vllm_config")

    device = next(model.parameters()).device
    layers = _expert_layers(model)  # By vLLM's layer name.
    where = {id(module): prefix for prefix, module in model.named_modules()}  # Each module's parameter prefix.
    by_prefix = {where[id(layer)]: layer for layer in layers.values()}
    targets, quantized = [], {}
    # vLLM names an expert layer as the checkpoint does, e.g. model.layers.0.mlp.experts, but its
    # parameters may sit deeper, e.g. model.layers.0.mlp.experts.routed_experts.w13_weight.
    unchecked_layers = tuple(f"{layer.layer_name}." for _, layer in fp8_layers_by_vllms_loader(model, sent))
    with torch.no_grad(), set_current_vllm_config(vllm_config):
        for index, (name, dtype, shape, block) in enumerate(sent):
            if block:
                layer_name, _, tensor_name = name.rpartition(".")
                layer, param_name = layers[layer_name], EXPERT_TENSORS[tensor_name]
                targets.append([f"{where[id(layer)]}.{param_name}"])
                if fp8_scales(layer, param_name) is not None:  # FP8 writes its weight and its scales, each whole.
                    targets[-1].append(f"{targets[-1][0]}_scale_inv")
                    quantized[index] = f"{FP8_BLOCKS}{fp8_shards(layer, param_name)}"
                continue
            if unchecked_layers and name.startswith(unchecked_layers):  # FP8 expert layers are not probed.
                targets.append([])
                continue
            # Use a distinct constant, not zeros, so piece_rows can read back where each piece landed.
            loaded = sorted(model.load_weights([(name, _probe(index, shape, dtype, device))]) or ())
            targets.append([t for t in loaded if not _held_elsewhere(name, by_prefix.get(t.rpartition(".")[0]))])
    params = dict(model.named_parameters())
    casts = {}
    for index, ((_, dtype, _, _), names) in enumerate(zip(sent, targets, strict=True)):
        held = {str(params[n].dtype).removeprefix("torch.") for n in names if n in params}
        if index in quantized:
            casts[index] = quantized[index]
        elif held and held != {dtype}:
            casts[index] = held.pop()
    pieces = _pieces(targets)
    whole = sorted(
        n
        for n, idx in pieces.items()
        if len(idx) == 1 and n in params and (tuple(sent[idx[0]][2]) == tuple(params[n].shape) or idx[0] in quantized)
    )
    return targets, casts, _relaid_out(sent, targets, by_prefix), whole


def _pieces(targets: list[list[str]]) -> dict[str, list[int]]:
    """Return {parameter: the indices of the sent tensors written into it}, from exact_targets' targets."""
    pieces: dict[str, list[int]] = {}
    for index, names in enumerate(targets):
        for n in names:
            pieces.setdefault(n, []).append(index)
    return pieces


def _relaid_out(sent: list, targets: list[list[str]], by_prefix: dict) -> list[str]:
    """Return the fused-expert parameters that can only be compared by their values.

    vLLM's own loader lays out its own way what it fills from a fused checkpoint tensor or from GPT-OSS's
    per-expert tensors; GPT-OSS's become [E, H, 2I], transposed. The direct loader's blocks are copied
    unchanged and other families' per-expert tensors are stacked, so those are compared whole.
    """
    out = set()
    for (name, _, _, block), names in zip(sent, targets, strict=True):
        gpt_oss_expert = re.search(r"\.experts\.\d+\.w(13|2)_(weight|bias)$", name)  # vLLM transposes these.
        if block or (_ONE_EXPERT.search(name) and not gpt_oss_expert):
            continue
        out |= {t for t in names if t.rpartition(".")[0] in by_prefix}
    return sorted(out)


# The probe loaded in place of each piece has every element equal to a bf16 value of its own,
# 0x3F81 + k, which is 1.0078125 and up, finite and exact in fp32. So each row of the parameter
# tells piece_rows which piece wrote it.
_PROBE_BITS, _PROBES = 0x3F81, 0x7F7F - 0x3F81


def _probe(index: int, shape, dtype: str, device) -> torch.Tensor:
    if not getattr(torch, dtype).is_floating_point:  # No stacked parameter is written from these.
        return torch.zeros(shape, dtype=getattr(torch, dtype), device=device)
    value = torch.tensor(_PROBE_BITS + index % _PROBES, dtype=torch.int16).view(torch.bfloat16).item()
    return torch.full(shape, value, dtype=getattr(torch, dtype), device=device)


def piece_rows(
    model: torch.nn.Module, sent: list, targets: list[list[str]], whole=(), values_only=()
) -> tuple[dict[int, int], list[str], list[str]]:
    """Find where each piece of a parameter written from several sent tensors lands in it.

    Examples are q/k/v into qkv_proj, gate and up, and each expert's tensors into a fused w13 or w2. Call it
    right after exact_targets, with that function's arguments and answer: exact_targets loaded each piece
    through the model's own `load_weights` as its own constant, and this reads back which rows of the
    parameter hold that constant, seeing the parameter as the fingerprint does, [rows, last dim].

    Return three things: {sent index: the dim-0 row the piece starts at}, for fingerprint_sums' row_offset;
    the parameters whose pieces were all placed, compared element by element in their place like a `whole`
    one; and the parameters compared by their values alone, which are `values_only` and any whose pieces do
    not each land on one block of whole rows.
    """
    params = dict(model.named_parameters())
    pieces = _pieces(targets)
    skip = set(whole) | set(values_only)
    stacked = {
        n: idx for n, idx in pieces.items() if n in params and n not in skip and not any(sent[i][3] for i in idx)
    }
    at_start = {i for n in whole for i in pieces.get(n, ())}  # Also written whole into another, so at row 0.
    rows: dict[int, int] = {}
    placed, by_value = [], set(values_only) & params.keys()
    for name, idx in stacked.items():
        found = _rows_of_pieces(params[name], idx, sent)
        if found is None or any(rows.get(i, 0 if i in at_start else r) != r for i, r in found.items()):
            by_value.add(name)
            continue
        rows.update(found)
        placed.append(name)
    return rows, sorted(placed), sorted(by_value)


@torch.no_grad()
def _rows_of_pieces(param: torch.Tensor, indices: list[int], sent: list) -> dict[int, int] | None:
    """Return {sent index: its dim-0 row offset} for the pieces `indices` of `param`, or None.

    Each piece must be found as one block of whole rows holding its probe. Return None if any piece is not,
    such as a piece with another last dim or one that vLLM lays out again.
    """
    columns = columns_of(param)
    view = param.detach().reshape(-1, columns)
    codes = torch.full((view.shape[0],), -1, dtype=torch.int64)
    step = max(1, FINGERPRINT_CHUNK // columns)
    for start in range(0, view.shape[0], step):
        chunk = view[start : start + step]
        first = chunk[:, :1]
        same = (chunk == first).all(1)
        bits = first[:, 0].to(torch.bfloat16).view(torch.int16).to(torch.int64) - _PROBE_BITS
        codes[start : start + step] = torch.where(same & (bits >= 0) & (bits < _PROBES), bits, -1).cpu()
    out = {}
    for index in indices:
        _, _, shape, _ = sent[index]
        piece = torch.empty(shape, device="meta")
        if columns_of(piece) != columns:
            return None
        at = (codes == index % _PROBES).nonzero().flatten()
        count = piece.numel() // columns
        if len(at) != count or count == 0 or int(at[-1] - at[0]) != count - 1:
            return None
        per_row = math.prod(piece.shape[1:-1]) if piece.dim() >= 2 else 1
        if int(at[0]) % per_row:
            return None
        out[index] = int(at[0]) // per_row
    return out


def probed_parameters(sent: list, targets: list[list[str]]) -> list[str]:
    """Return the parameters exact_targets loaded a probe into.

    Those are the parameters written by any sent tensor except a direct-loader block, which is copied, not
    probed.
    """
    return sorted({n for (_, _, _, block), names in zip(sent, targets, strict=True) if not block for n in names})


def fp8_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Return (module prefix, layer) of each expert layer vLLM serves in FP8."""
    return [(prefix, m) for prefix, m in model.named_modules() if fp8_scales(m, "w13_weight") is not None]


def fp8_layers_by_vllms_loader(model: torch.nn.Module, sent: list) -> list[tuple[str, torch.nn.Module]]:
    """Return (module prefix, layer) of each FP8 expert layer that no direct-loader block is sent to."""
    blocks = {name.rpartition(".")[0] for name, _, _, block in sent if block}
    return [(prefix, layer) for prefix, layer in fp8_layers(model) if layer.layer_name not in blocks]


def _held_elsewhere(sent_name: str, experts: torch.nn.Module | None) -> bool:
    """Return whether `sent_name` is the checkpoint tensor of an expert that another engine holds.

    `experts` is the fused expert layer `sent_name` is written into, or None if it is not an expert layer.
    Checkpoint names look like `...experts.<id>....`. vLLM's loader skips such tensors, so they add nothing
    here.
    """
    found = _ONE_EXPERT.search(sent_name)
    return experts is not None and found is not None and int(found.group(1)) not in local_expert_ids(experts)
