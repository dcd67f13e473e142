"""What a trainer should send vLLM: the tensors `save_pretrained` would write.

vLLM's loaders are written against checkpoints on disk, not against
transformers' in-memory modules, and transformers 5 keeps many models in a
different form in memory: Mixtral's `block_sparse_moe.experts.N.w1.weight`
files become one fused `mlp.experts.gate_up_proj`; DeepSeek-V3's
`mlp.gate.e_score_correction_bias` is a buffer, so `named_parameters()` never
yields it. Rather than a table per family, this module asks transformers
itself: `save_pretrained` takes `state_dict()` (parameters and persistent
buffers), drops tied copies, and runs `revert_weight_conversion`, the reverse
of the conversion `from_pretrained` applied. We do the same, one group of
tensors at a time, so a sharded trainer holds one FSDP module gathered at a time:

    form = CheckpointForm(model, torch.bfloat16)  # once: names, shapes, groups (meta only)
    form.metadata                                 # [(name, shape, dtype)]
    for name, tensor in form: ...                 # every sync

It works on the meta device and under FSDP2: each FSDP module's parameters
are gathered with one `unshard()` (one all-gather, not one per parameter) and
freed with `reshard()` once its tensors are sent; buffers are not sharded.

Cost: `revert_weight_conversion` takes a whole state dict, and without a
`model._weight_conversions` (set by `from_pretrained`) it rebuilds the model's
conversion list (a walk over `named_modules()` plus a deepcopy) on every call.
We call it once per in-memory tensor group, so we attach that list once
(`_conversions`) the way `from_pretrained` does; what is left per call is
reversing a handful of regex transforms (tens of microseconds) plus the
conversion itself (for fused experts: one `chunk` per expert, and a copy of the
gate/up halves, which `Chunk` makes contiguous).

The fast path (the direct loader copying a rank's own fused expert shard into
vLLM's `w13_weight`/`w2_weight`) needs more than vLLM accepting a name: the
in-memory tensor must already be in vLLM's layout. `fused_expert_tensors` says
which tensors are fused experts and in which layout (models.direct_loader_problem
uses it), and `expert_block_names` which vLLM expert layer each one belongs to
(tests/test_families.py checks both against vLLM's own models).
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from collections.abc import Iterator

import torch

# ---------------------------------------------------------------------------
# Trainer side: the checkpoint form of a transformers model
# ---------------------------------------------------------------------------


def state_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What `save_pretrained` starts from, without copying anything:
    parameters and persistent buffers under their `state_dict()` names, each
    tied weight once (the name `named_parameters()` keeps, which is the tie's
    source, e.g. `model.embed_tokens.weight`), minus `_keys_to_ignore_on_save`.
    Values are the live (possibly DTensor or meta) tensors."""
    ignore = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    out = dict(model.named_parameters())  # remove_duplicate=True: a tied weight once
    for prefix, module in model.named_modules():
        for name, buf in module.named_buffers(prefix=prefix, recurse=False):
            leaf = name.rpartition(".")[2]
            if buf is not None and leaf not in module._non_persistent_buffers_set:
                out.setdefault(name, buf)
    return {k: v for k, v in out.items() if k not in ignore}


def _conversions(model: torch.nn.Module) -> None:
    """Attach transformers' conversion list to `model` once, as
    `from_pretrained` does (`revert_weight_conversion` would otherwise rebuild
    it on every call: the same list, minus PrefixChange, which it drops for a
    model not loaded from a checkpoint)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange

    if getattr(model, "_weight_conversions", None) is None:
        conversions = get_model_conversion_mapping(model, add_legacy=False)
        model._weight_conversions = [c for c in conversions if not isinstance(c, PrefixChange)] or None


def _revert(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from transformers.core_model_loading import revert_weight_conversion

    _conversions(model)
    return revert_weight_conversion(model, tensors)


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def conversion_groups(model: torch.nn.Module) -> list[list[str]]:
    """In-memory names grouped so that each group reverts on its own: every
    name alone, except names whose reversal writes the same checkpoint name
    (a checkpoint tensor that `from_pretrained` split into several, such as a
    fused qkv). Computed on meta tensors: no data is touched."""
    state = state_tensors(model)
    owners: dict[str, list[str]] = defaultdict(list)
    for name, t in state.items():
        for out in _revert(model, {name: _meta(t)}):
            owners[out].append(name)
    # union the names that share an output (a tiny union-find over names)
    parent = {name: name for name in state}

    def root(n: str) -> str:
        while parent[n] != n:
            n = parent[n]
        return n

    for names in owners.values():
        for other in names[1:]:
            parent[root(other)] = root(names[0])
    groups: dict[str, list[str]] = defaultdict(list)
    for name in state:
        groups[root(name)].append(name)
    return list(groups.values())


def _cast_dtype(model: torch.nn.Module, name: str, tensor: torch.Tensor, dtype: torch.dtype | None):
    """`dtype` for floating tensors, except those transformers keeps in fp32
    whatever the model's dtype (`_keep_in_fp32_modules_strict`, e.g. the
    routers' e_score_correction_bias), which vLLM also holds in fp32."""
    if dtype is None or not tensor.is_floating_point():
        return tensor.dtype
    keep = getattr(model, "_keep_in_fp32_modules_strict", None) or ()
    if keep and re.search("|".join(re.escape(k) for k in keep), name):
        return torch.float32
    return dtype


class CheckpointForm:
    """The checkpoint form of `model`, worked out once from its structure
    (meta tensors: no data touched) and produced on demand, one conversion
    group at a time; under FSDP2 one all-gather per FSDP module (its
    `unshard()`), not one per parameter:

        form = CheckpointForm(model, torch.bfloat16)
        form.metadata                   # [(checkpoint name, shape, dtype)], in order
        for name, tensor in form: ...   # the same tensors, with their data
        form.origins                    # each one's (module, attribute), if it is that tensor cast

    `dtype` casts floating tensors (see `_cast_dtype`); `exclude`: in-memory
    names to leave out (a caller sending those its own way). A group that
    transformers' conversion leaves as it is (one tensor, same name and shape:
    most of them) skips the conversion on every sync."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype | None = None, exclude=()) -> None:
        self._model, self._dtype = model, dtype
        state, excluded, params = state_tensors(model), set(exclude), {n for n, _ in model.named_parameters()}
        self._groups, self._unchanged, self._owners, self._group_metadata = [], [], [], []
        for group in conversion_groups(model):
            if set(group) & excluded:
                if not set(group) <= excluded:  # would drop a tensor nobody sends
                    raise ValueError(f"{sorted(set(group) - excluded)} convert together with "
                                     f"{sorted(set(group) & excluded)}, which are sent another way")  # fmt: skip
                continue
            meta = {n: _meta(state[n]) for n in group}
            out = _revert(model, meta)
            self._groups.append(group)
            self._unchanged.append(list(out) == group and all(out[n] is meta[n] for n in group))
            metadata = [(name, tuple(t.shape), _cast_dtype(model, name, t, dtype)) for name, t in out.items()]
            self._owners.append(_fsdp_owner(model, params, group, {d for *_, d in metadata}, dtype))
            self._group_metadata.append(metadata)
        # Where each tensor lives (module, attribute), found once: FSDP2 swaps the attribute
        # for the unsharded parameter while its module is unsharded, so it is read on every sync.
        self._where = {n: (model.get_submodule(n.rpartition(".")[0]), n.rpartition(".")[2])
                       for group in self._groups for n in group}  # fmt: skip
        # Each tensor's origin where it is one model tensor, cast (its whole tensor under FSDP2):
        # (module, attribute); None where a conversion makes it from others.
        origins = [[self._where[name] for name, _, _ in metadata] if unchanged else [None] * len(metadata)
                   for metadata, unchanged in zip(self._group_metadata, self._unchanged, strict=True)]  # fmt: skip
        order = _gather_order(self._owners)
        self._groups, self._unchanged, self._owners = ([x[i] for i in order] for x in
                                                       (self._groups, self._unchanged, self._owners))  # fmt: skip
        self.metadata = [m for i in order for m in self._group_metadata[i]]
        self.origins = [o for i in order for o in origins[i]]

    @torch.no_grad()
    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        unsharded = None  # the FSDP2 module whose parameters are gathered now
        try:
            for group, unchanged, owner in zip(self._groups, self._unchanged, self._owners, strict=True):
                if owner is not unsharded:
                    if unsharded is not None:
                        unsharded.reshard()
                    if owner is not None:
                        owner.unshard()  # one all-gather for all its parameters, in its compute dtype
                    unsharded = owner
                gathered = {n: _full(getattr(*self._where[n])).detach() for n in group}
                if owner is not None and (wrong := {t.dtype for t in gathered.values()} - {self._dtype, torch.float32}):
                    raise ValueError(f"FSDP gathers {group} in {wrong}: its compute dtype (MixedPrecisionPolicy's "
                                     f"param_dtype) must be {self._dtype} or float32 to send them in {self._dtype}")  # fmt: skip
                for name, t in (gathered if unchanged else _revert(self._model, gathered)).items():
                    # A copy of what FSDP gathered: reshard() frees its memory, and a
                    # consumer may keep what it was given (vLLM's unpacked send does).
                    yield name, t.to(_cast_dtype(self._model, name, t, self._dtype), copy=owner is not None)
                del gathered
        finally:  # also when the consumer stops early: the module's own (sharded) parameters back
            if unsharded is not None:
                unsharded.reshard()


def _gather_order(owners: list) -> list[int]:
    """The groups in an order that gathers each FSDP module once per sync:
    each module's groups together, where its first group was (the root's
    embeddings and lm_head, a layer's experts and its norms are apart in the
    model's own order); a group no module gathers keeps its place."""
    def module_of(i: int):
        return id(owners[i]) if owners[i] is not None else ("alone", i)

    first: dict = {}
    for i in range(len(owners)):
        first.setdefault(module_of(i), i)
    return sorted(range(len(owners)), key=lambda i: (first[module_of(i)], i))


def _fsdp_owner(model: torch.nn.Module, params: set[str], names: list[str], dtypes: set[torch.dtype],
                dtype: torch.dtype | None):  # fmt: skip
    """The FSDP2 module whose unshard() gathers the parameters `names`
    (`params`: the model's parameter names), if one module does and all are
    sent cast to `dtype` (FSDP's gather in its compute dtype then gives the
    same bits as gathering and casting); else None: each is then gathered on
    its own with full_tensor()."""
    from torch.distributed.fsdp import FSDPModule

    owners = set()
    for name in names:
        if name not in params:
            continue  # a buffer: not sharded
        module = name.rpartition(".")[0]
        while not isinstance(model.get_submodule(module), FSDPModule):
            if not module:
                return None
            module = module.rpartition(".")[0]
        owners.add(module)
    if len(owners) != 1 or dtype is None or dtypes != {dtype}:
        return None
    return model.get_submodule(owners.pop())


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


# ---------------------------------------------------------------------------
# The in-memory fused expert tensors (what the direct loader copies as they are)
# ---------------------------------------------------------------------------


def fused_expert_tensors(model: torch.nn.Module) -> dict[str, dict]:
    """The in-memory parameters that hold all experts of a layer stacked on
    dim 0 (name -> global shape and layout), i.e. those a rank holds a block
    of experts of under FSDP2. Found through transformers' own marker: the
    modules `use_experts_implementation` wraps carry `num_experts`,
    `is_transposed` ([E, H, 2I] instead of [E, 2I, H]) and `is_concatenated`
    (gate rows then up rows, rather than interleaved)."""
    out = {}
    for prefix, module in model.named_modules():
        if not hasattr(module, "is_concatenated") or not hasattr(module, "num_experts"):
            continue
        for name, p in module.named_parameters(prefix=prefix, recurse=False):
            if p.dim() >= 2 and p.shape[0] == module.num_experts:
                out[name] = {
                    "shape": tuple(p.shape),
                    "transposed": bool(module.is_transposed),
                    "concatenated": bool(module.is_concatenated),
                }
    return out


def expert_block_names(model: torch.nn.Module) -> dict[str, str]:
    """Each fused expert tensor's in-memory name -> the name the direct loader
    receives a rank's block of it under: its leaf name under the experts
    module's CHECKPOINT name, which is the name vLLM gives its fused expert
    layer. Mixtral: `model.layers.0.mlp.experts.gate_up_proj` ->
    `model.layers.0.block_sparse_moe.experts.gate_up_proj` (the checkpoint has
    `...block_sparse_moe.experts.<e>.w1.weight`, ...). The module's name is
    the common prefix of its experts' checkpoint names, minus expert ids."""
    by_module: dict[str, list[str]] = defaultdict(list)
    for name in fused_expert_tensors(model):
        by_module[name.rpartition(".")[0]].append(name)
    out, params = {}, dict(model.named_parameters())
    for names in by_module.values():
        saved = [out_name for n in names for out_name in _revert(model, {n: _meta(params[n])})]
        parts = os.path.commonprefix(saved).split(".")[:-1]  # whole components only
        while parts and parts[-1].isdigit():
            parts.pop()
        out.update({n: ".".join([*parts, n.rpartition(".")[2]]) for n in names})
    return out
