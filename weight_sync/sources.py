# SPDX-License-Identifier: Apache-2.0
"""Build what a trainer rank sends, for helpers.weight_sender.

CheckpointForm and BF16Source produce the weights in checkpoint form, which is what vLLM's own loader reads:
every family's checkpoint names, persistent buffers included, gathered one FSDP module at a time. The direct
loader's trainer half is LocalExpertSource, which sends each rank's own expert blocks without a gather;
InPlace, which lets the engine copy those blocks, and every tensor a rank holds whole as it is sent, straight
from the trainer's memory; and DirectLoadClient, which hands the chunks to the server's direct_load.py.
engines_lack asks the server's engines whether their vLLM lacks what the direct loader needs. A rank builds its
sender like this:

    source = weight_source(model, world_size, "direct")     # or "vllm": vLLM's own loader
    client = sync_client(sock, "direct", source, trainer_gpu_uuids)
    sender = helpers.weight_sender(rank, client, source)
"""

from __future__ import annotations

import itertools
import json
import os
import re
from collections import defaultdict
from collections.abc import Iterator
from functools import partial

import torch
from vllm.distributed.weight_transfer.base import ParamMeta

from helpers import ServerError, WeightSyncClient, collective_rpc, every_rank, metadata_bytes
from weight_sync.direct_load import TrainerSource, vllm_load_form
from weight_sync.vllm_adapter import DIRECT_LOADER, engine_lacks


def weight_source(model: torch.nn.Module, world_size: int, loader: str = "direct") -> TrainerSource:
    """Return what vLLM receives from a rank of `model`, in bf16 whatever the master dtype.

    `model` is sharded with FSDP2 over `world_size` ranks, or whole on one. The direct loader gets each rank's
    own experts and the rest whole (LocalExpertSource); vLLM's loader gets the checkpoint form (BF16Source)."""
    return LocalExpertSource(model, world_size) if loader == "direct" else BF16Source(model)


def sync_client(sock: str, loader: str, source: TrainerSource, trainer_gpu_uuids: list[str]):
    """Return the client rank 0 calls for each chunk: the direct loader's, or vLLM's weight routes.

    When weight_sender builds vLLM's engine, the direct loader's client first has every engine check that it
    holds the expert blocks `source` will send and that a trainer rank is on its GPU."""
    if loader == "direct":
        in_place = getattr(source, "in_place", None)
        skipped = set(in_place.names) if in_place is not None else set()  # weight_sender sends these in place
        packed_bytes = metadata_bytes(m for m in source.metadata if m.name not in skipped)
        others = [
            [m.name, list(m.shape), str(m.dtype).removeprefix("torch.")]
            for m in source.metadata
            if m.name not in source.expert_blocks
        ]
        return DirectLoadClient(sock, trainer_gpu_uuids, source.expert_blocks, in_place, packed_bytes, others)
    return WeightSyncClient(sock)


def engines_lack(sock: str, needed_by: str = DIRECT_LOADER, rollout_dtype: str = "bf16") -> tuple[str, str] | None:
    """Ask every engine whether its vLLM lacks what `needed_by` needs ("the direct loader" or "the exact check").

    Return None if none does, else (which engine's vLLM, what it lacks, in one line), from the first engine that
    lacks something (DirectLoadWorker.direct_load_lacks)."""
    try:
        collective_rpc(sock, "direct_load_lacks", needed_by, rollout_dtype)
    except ServerError as e:
        if (lacks := engine_lacks(str(e))) is None:
            raise
        return lacks
    return None


class DirectLoadClient:
    """vLLM's HTTPVLLMWeightSyncClient calls, sent to the server's direct loader through /collective_rpc.

    `expert_blocks` maps the name of each expert block a rank will send to its shape. It is checked against every
    engine when vLLM's IPC engine is built, so a layout the server cannot take fails before any send. The send's
    first chunk also starts the sync on the engines. `packed_bytes`, if given, is what a send's chunks carry in
    all, so the chunk that completes it also finishes the sync, and a send of one chunk is one round trip. A send
    with nothing packed, every tensor `in_place`, is one round trip too."""

    def __init__(
        self,
        sock: str,
        trainer_gpu_uuids: list[str],
        expert_blocks: dict[str, tuple],
        in_place: InPlace | None = None,
        packed_bytes: int | None = None,
        other_tensors: list | None = None,
    ) -> None:
        if len(set(trainer_gpu_uuids)) != len(trainer_gpu_uuids):
            raise ValueError(
                f"two trainer ranks on one GPU ({trainer_gpu_uuids}): the direct loader needs one rank per GPU"
            )
        self.sock = sock
        self.trainer_gpu_uuids = list(trainer_gpu_uuids)
        self.expert_blocks = {name: list(shape) for name, shape in expert_blocks.items()}
        self.in_place = in_place  # on rank 0: every rank's handles, gathered before each send
        self.packed_bytes = packed_bytes
        self.other_tensors = other_tensors  # [name, shape, dtype] of the rest: the engines learn their layout
        self.learned: dict | None = None  # what the first DP engine learned, when the engine was built
        self._start: dict | None = None  # what the engines' direct_load_start takes, until a call carries it
        self._left: int | None = None  # the bytes this send's chunks still have to carry
        self._finished: dict | None = None  # what the last chunk's finish reported
        # The handles the engines hold from the last send that went through, and their version: a send whose
        # handles are the same names only their version, which keeps a sync's request small.
        self._handles_held: tuple[int, dict] | None = None
        self._sending: tuple[int, dict] | None = None  # the version and handles of the send under way

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        if not init_info.get("packed"):
            raise ValueError("the direct loader reads packed IPC buffers: use packed=True")
        expected = {"blocks": self.expert_blocks, "dtype": "bfloat16", "trainer_gpu_uuids": self.trainer_gpu_uuids}
        collective_rpc(self.sock, "direct_load_check", json.dumps(expected))
        if self.other_tensors:  # before the first sync, so that it copies at full speed
            self.learned = collective_rpc(self.sock, "direct_load_learn", json.dumps(self.other_tensors))[0]

    def start_weight_update(self) -> dict:
        """Prepare a send without asking the server; the engines start with its first chunk.

        With tensors in place, each engine then copies its trainer rank's tensors from the trainer's memory."""
        self._left, self._finished = self.packed_bytes, None
        handles = self.in_place.gathered if self.in_place is not None else None
        self._start = {"trainer_gpu_uuids": self.trainer_gpu_uuids, **self._handles(handles)} if handles else {}
        return {}

    def _handles(self, handles: dict) -> dict:
        """Return the start's handles: all of them, or only their version if the engines hold them already."""
        held, self._handles_held = self._handles_held, None  # held again once this send goes through
        if held is not None and held[1] == handles:
            self._sending = held
            return {"version": held[0]}
        self._sending = (held[0] + 1 if held else 1, handles)
        return {"version": self._sending[0], "tensors": handles}

    def update_weights(self, update_info: dict) -> dict:
        """Send one chunk and return what the first DP engine reports of it.

        The first chunk also starts the sync on the engines, and the last one also finishes it."""
        if self._left is not None:
            self._left -= sum(update_info["tensor_sizes"])
        update = {**update_info, "trainer_gpu_uuids": self.trainer_gpu_uuids, "last": self._left == 0}
        if self._start is not None:
            update["start"], self._start = self._start, None
        try:
            result = collective_rpc(self.sock, "direct_load_chunk", _pickled(update))[0]
        except Exception:
            self._sending = None  # the engines may not hold this send's handles: the next one carries them all
            raise
        self._finished = result.get("finished")
        if self._finished is not None:
            self._handles_held = self._sending
        return result

    def finish_weight_update(self, weight_version: str | None = None) -> dict:
        """Finish the sync unless its last chunk did; return what the first DP engine reports of it.

        A send without chunks starts and finishes here, in one call."""
        finished, self._finished, self._left = self._finished, None, None
        if finished is not None:
            return finished
        if self._start is None:
            finished = collective_rpc(self.sock, "direct_load_finish")[0]
        else:
            self._left = 0  # so that this chunk of nothing is the last
            nothing = {"names": [], "dtype_names": [], "shapes": [], "tensor_sizes": [], "ipc_handles": {}}
            result = self.update_weights(nothing)
            finished = {**result["finished"], "seconds": result["seconds"]}  # where the engine's time went
            self._finished = self._left = None
        self._handles_held = self._sending
        return finished

    def shutdown_weight_transfer_engine(self) -> None:
        pass


def _pickled(value) -> str:
    """Return `value` pickled and base64-encoded, as the direct loader takes CUDA IPC handles."""
    import base64
    import pickle

    return base64.b64encode(pickle.dumps(value)).decode()


# ===========================================================================
# What a trainer rank sends: the tensors `save_pretrained` would write
# ===========================================================================

# vLLM's loaders are written against checkpoints on disk, but transformers keeps many models in another form
# in memory. Mixtral's per-expert w1/w2/w3 tensors become one fused `mlp.experts.gate_up_proj`, and
# DeepSeek-V3's router bias is a buffer, which `named_parameters()` never yields. Rather than keep a table per
# family, ask transformers: `save_pretrained` writes `state_dict()` minus tied copies, through
# `revert_weight_conversion`. CheckpointForm does the same one group of tensors at a time, gathering each FSDP2
# module once. The direct loader's fast path also needs the in-memory fused experts in vLLM's layout, from
# fused_expert_tensors and direct_loader_problem, and the vLLM layer each belongs to, from expert_block_names.
# tests/test_families.py checks both against vLLM's own models.


def state_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Return what `save_pretrained` starts from, without copying anything.

    That is the parameters and persistent buffers under their `state_dict()` names, minus
    `_keys_to_ignore_on_save`. A tied weight appears once, under the name `named_parameters()` keeps, which is
    the tie's source, e.g. `model.embed_tokens.weight`. Values are the live tensors, possibly DTensors or meta."""
    ignore = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    out = dict(model.named_parameters())  # remove_duplicate=True: a tied weight once
    for prefix, module in model.named_modules():
        for name, buf in module.named_buffers(prefix=prefix, recurse=False):
            leaf = name.rpartition(".")[2]
            if buf is not None and leaf not in module._non_persistent_buffers_set:
                out.setdefault(name, buf)
    return {k: v for k, v in out.items() if k not in ignore}


def _conversions(model: torch.nn.Module) -> None:
    """Attach transformers' conversion list to `model` once, as `from_pretrained` does.

    Otherwise `revert_weight_conversion` rebuilds it on every call. The list is the same, minus PrefixChange,
    which transformers drops for a model not loaded from a checkpoint."""
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
    """Group the in-memory names so that each group reverts on its own.

    Every name stands alone, except names whose reversal writes the same checkpoint name: a checkpoint tensor,
    such as a fused qkv, that `from_pretrained` split into several. Computed on meta tensors, touching no data."""
    state = state_tensors(model)
    owners: dict[str, list[str]] = defaultdict(list)
    for name, t in state.items():
        for out in _revert(model, {name: _meta(t)}):
            owners[out].append(name)
    # Union the names that share an output, with a tiny union-find.
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
    """Return `dtype` for floating tensors, except fp32 for those transformers keeps in fp32 whatever the dtype.

    Those are `_keep_in_fp32_modules_strict`, e.g. the routers' e_score_correction_bias, which vLLM also holds in
    fp32."""
    if dtype is None or not tensor.is_floating_point():
        return tensor.dtype
    keep = getattr(model, "_keep_in_fp32_modules_strict", None) or ()
    if keep and re.search("|".join(re.escape(k) for k in keep), name):
        return torch.float32
    return dtype


class CheckpointForm:
    """The checkpoint form of `model`, worked out once and produced on demand, one conversion group at a time.

    The form is worked out on meta tensors, touching no data. Under FSDP2 each FSDP module is gathered with one
    all-gather, its `unshard()`, not one per parameter:

        form = CheckpointForm(model, torch.bfloat16)
        form.metadata                   # [(checkpoint name, shape, dtype)], in order
        for name, tensor in form: ...   # the same tensors, with their data
        form.origins                    # each one's (module, attribute), if it is that tensor cast

    `dtype` casts floating tensors as `_cast_dtype` says. `exclude` lists in-memory names to leave out, for a
    caller that sends those its own way. With `fresh`, every tensor stays valid while the consumer keeps it: a
    copy of what FSDP gathered, or the parameter itself where nothing is gathered. Without it, where no cast is
    needed, a tensor is what FSDP gathered and is valid only until the next one is taken, which suits a consumer
    that copies each at once. A group that transformers' conversion leaves as it is, one tensor with the same
    name and shape, skips the conversion on every sync; most groups are like that."""

    def __init__(
        self, model: torch.nn.Module, dtype: torch.dtype | None = None, exclude=(), fresh: bool = True
    ) -> None:
        self._model, self._dtype, self._fresh = model, dtype, fresh
        state, excluded, params = state_tensors(model), set(exclude), {n for n, _ in model.named_parameters()}
        self._groups, self._unchanged, self._owners, self._group_metadata, renamed = [], [], [], [], []
        for group in conversion_groups(model):
            if set(group) & excluded:
                if not set(group) <= excluded:  # would drop a tensor nobody sends
                    raise ValueError(
                        f"{sorted(set(group) - excluded)} convert together with "
                        f"{sorted(set(group) & excluded)}, which are sent another way"
                    )
                continue
            meta = {n: _meta(state[n]) for n in group}
            out = _revert(model, meta)
            self._groups.append(group)
            self._unchanged.append(list(out) == group and all(out[n] is meta[n] for n in group))
            renamed.append(len(group) == len(out) == 1 and next(iter(out.values())) is meta[group[0]])
            metadata = [(name, tuple(t.shape), _cast_dtype(model, name, t, dtype)) for name, t in out.items()]
            self._owners.append(_fsdp_owner(model, params, group, {d for *_, d in metadata}, dtype))
            self._group_metadata.append(metadata)
        # Where each tensor lives, as (module, attribute), found once. FSDP2 swaps the attribute for the
        # unsharded parameter while its module is unsharded, so the attribute is read on every sync.
        self._where = {
            n: (model.get_submodule(n.rpartition(".")[0]), n.rpartition(".")[2])
            for group in self._groups
            for n in group
        }
        # Each tensor's origin: (module, attribute) where it is one model tensor, cast or renamed, whole under
        # FSDP2; (module, attribute, (expert, first row of dim 1, rows)) where it is one expert's piece of a
        # fused expert tensor; None where a conversion makes it from several tensors.
        fused = fused_expert_tensors(model)
        origins = []
        for group, metadata, unchanged, only_renamed in zip(
            self._groups, self._group_metadata, self._unchanged, renamed, strict=True
        ):
            if unchanged or only_renamed:
                origins.append([self._where[name] for name in group])
            else:
                origins.append(_expert_origins(group, metadata, self._where, fused))
        order = _gather_order(self._owners)
        # Each group's tensors' dtypes as sent, by name: worked out here, not on every sync.
        dtypes = [{name: dtype for name, _, dtype in metadata} for metadata in self._group_metadata]
        self._groups, self._unchanged, self._owners, self._dtypes = (
            [x[i] for i in order] for x in (self._groups, self._unchanged, self._owners, dtypes)
        )
        self.metadata = [m for i in order for m in self._group_metadata[i]]
        self.origins = [o for i in order for o in origins[i]]

    @torch.no_grad()
    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        unsharded = None  # the FSDP2 module whose parameters are gathered now
        try:
            for group, unchanged, owner, dtypes in zip(
                self._groups, self._unchanged, self._owners, self._dtypes, strict=True
            ):
                if owner is not unsharded:
                    if unsharded is not None:
                        unsharded.reshard()
                    if owner is not None:
                        owner.unshard()  # one all-gather for all its parameters, in its compute dtype
                    unsharded = owner
                gathered = {n: _full(getattr(*self._where[n])).detach() for n in group}
                if owner is not None and (wrong := {t.dtype for t in gathered.values()} - {self._dtype, torch.float32}):
                    raise ValueError(
                        f"FSDP gathers {group} in {wrong}: its compute dtype (MixedPrecisionPolicy's "
                        f"param_dtype) must be {self._dtype} or float32 to send them in {self._dtype}"
                    )
                for name, t in (gathered if unchanged else _revert(self._model, gathered)).items():
                    # Fresh: copy what FSDP gathered, since reshard() frees its memory and a consumer may keep
                    # what it was given, as vLLM's unpacked send does.
                    yield name, t.to(dtypes[name], copy=self._fresh and owner is not None)
                del gathered
        finally:  # also when the consumer stops early: put the module's sharded parameters back
            if unsharded is not None:
                unsharded.reshard()


# Which rows of a fused expert tensor each expert's checkpoint tensor must have been cut from, by its name.
# gate_up_proj is [E, 2I, H] with the gate rows first; down_proj is [E, H, I].
_EXPERT_PIECES = {
    "gate_up_proj": {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1},
    "down_proj": {"down_proj": None, "w2": None},
}
_ONE_EXPERT_TENSOR = re.compile(r"\.experts\.(\d+)\.(\w+)\.weight$")


def _expert_origins(group: list[str], metadata: list[tuple], where: dict, fused: dict) -> list:
    """Return the CheckpointForm.origins of the tensors a conversion makes of `group`.

    An expert's tensor cut from a fused expert tensor in vLLM's layout gets its slice, found from its checkpoint
    name alone: the expert id, and gate, up or down. It does not come from what the conversion does, so a
    conversion that cuts the wrong slice fails the exact check. Other tensors get None."""
    layout = fused.get(group[0]) if len(group) == 1 else None
    pieces = _EXPERT_PIECES.get(group[0].rpartition(".")[2])
    if layout is None or pieces is None or layout["transposed"] or not layout["concatenated"]:
        return [None] * len(metadata)
    experts, rows = layout["shape"][0], layout["shape"][1]
    origins = []
    for name, shape, _ in metadata:
        found = _ONE_EXPERT_TENSOR.search(name)
        half = pieces.get(found.group(2), "none") if found else "none"
        expert = int(found.group(1)) if found else experts
        size = rows if half is None else rows // 2
        if half == "none" or expert >= experts or tuple(shape) != (size, *layout["shape"][2:]):
            origins.append(None)
            continue
        origins.append((*where[group[0]], (expert, 0 if half is None else half * size, size)))
    return origins


def _gather_order(owners: list) -> list[int]:
    """Order the groups so that a sync gathers each FSDP module once.

    A module's groups go together, where its first group was; in the model's own order the root's embeddings
    and lm_head, or a layer's experts and its norms, are apart. A group no module gathers keeps its place."""

    def module_of(i: int):
        return id(owners[i]) if owners[i] is not None else ("alone", i)

    first: dict = {}
    for i in range(len(owners)):
        first.setdefault(module_of(i), i)
    return sorted(range(len(owners)), key=lambda i: (first[module_of(i)], i))


def _fsdp_owner(
    model: torch.nn.Module, params: set[str], names: list[str], dtypes: set[torch.dtype], dtype: torch.dtype | None
):
    """Return the FSDP2 module whose unshard() gathers the parameters `names`, or None.

    `params` holds the model's parameter names. A module is returned if it gathers them all and all are sent cast
    to `dtype`: FSDP's gather in its compute dtype then gives the same bits as gathering and casting. Otherwise
    each is gathered on its own with full_tensor(). Where FSDP2 shards over one rank, the one shard is the whole
    parameter and there is nothing to gather, so None is returned too."""
    from torch.distributed.fsdp import FSDPModule

    owners = set()
    for name in names:
        if name not in params:
            continue  # a buffer: not sharded
        if _whole_shard(model.get_parameter(name)):
            return None
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
    """Return a parameter's whole value: its FSDP2 shards gathered, or its one shard where it has only one."""
    if not hasattr(t, "full_tensor"):
        return t
    return t.to_local() if _whole_shard(t) else t.full_tensor()


def _whole_shard(t: torch.Tensor) -> bool:
    """Return whether `t` is a DTensor over one rank, whose local shard is all of it."""
    return hasattr(t, "device_mesh") and t.device_mesh.size() == 1


# ---------------------------------------------------------------------------
# The in-memory fused expert tensors, which the direct loader copies as they are
# ---------------------------------------------------------------------------


def fused_expert_tensors(model: torch.nn.Module) -> dict[str, dict]:
    """Map each in-memory parameter that stacks all of a layer's experts on dim 0 to its global shape and layout.

    Under FSDP2 a rank holds a block of experts of each. They are found through transformers' own marker: the
    modules `use_experts_implementation` wraps carry `num_experts`, `is_transposed`, which means [E, H, 2I]
    instead of [E, 2I, H], and `is_concatenated`, which means gate rows then up rows rather than interleaved."""
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
    """Map each fused expert tensor's in-memory name to the name the direct loader receives a rank's block under.

    That name is its leaf name under the experts module's checkpoint name, which is the name vLLM gives its fused
    expert layer. For Mixtral, `model.layers.0.mlp.experts.gate_up_proj` becomes
    `model.layers.0.block_sparse_moe.experts.gate_up_proj`, since the checkpoint has
    `...block_sparse_moe.experts.<e>.w1.weight`. The module's name is the common prefix of its experts'
    checkpoint names, minus expert ids."""
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


class PackedPart(TrainerSource):
    """The first `count` tensors of `source`: what goes through the packed buffer."""

    def __init__(self, source: TrainerSource, count: int) -> None:
        self._source, self._count = source, count

    def param_metas(self) -> list[ParamMeta]:
        return list(self._source.metadata[: self._count])

    def tensors(self):
        tensors = self._source.tensors()
        try:
            yield from itertools.islice(tensors, self._count)
        finally:
            tensors.close()  # skip the rest, so that a CheckpointForm reshards what it gathered


class InPlace:
    """Tensors the engine on a rank's GPU copies straight from the trainer's memory, so nothing is packed.

    They are the rank's own expert blocks, and every other tensor the rank holds whole and as it is sent: same
    dtype, contiguous, on the GPU, and unchanged by transformers' conversion. On one GPU that is every tensor of
    a bf16 model; over FSDP2 ranks the others are shards and go packed. Each tensor's CUDA IPC handle is exported
    once, while the tensor stays where it is: FSDP2 keeps a shard's storage and the optimizer steps it in place.
    The handles are gathered to rank 0 for every send, once the rank's GPU is synchronized."""

    def __init__(self, where: dict[str, tuple[torch.nn.Module, str]]) -> None:
        self.names = list(where)  # the names they are sent under, in send order
        self._where = list(where.values())  # the module and attribute that hold each
        self._exported: tuple[list, list] | None = None  # where the tensors were, and their handles
        self._gpu_uuid: str | None = None
        self.gathered: dict[str, list] | None = None  # every rank's handles by GPU, used on rank 0

    @staticmethod
    def possible(tensors: dict[str, tuple[torch.Tensor, torch.dtype]]) -> dict[str, bool]:
        """Return, for each name, whether every rank holds that tensor as it is sent, so that it can go in place.

        `tensors` maps a name to the rank's own storage of it and the dtype it is sent in. Every rank calls it at
        once with the same names, since each send's handshake must be the same on all of them."""
        here = [t.is_cuda and t.dtype == dtype and t.is_contiguous() for t, dtype in tensors.values()]
        everywhere = [all(held) for held in zip(*every_rank(here))]  # on any process group (helpers.sync_group)
        return dict(zip(tensors, everywhere, strict=True))

    def packed_part(self, source: TrainerSource) -> PackedPart:
        """Return the part of `source` that goes through the packed buffer while these tensors go in place.

        `source` must yield these tensors last; a source wrapped around it works too."""
        return PackedPart(source, len(source.metadata) - len(self.names))

    def local_tensors(self) -> list[torch.Tensor]:
        """Return each tensor's own storage on this rank, as its module holds it now."""
        with torch.no_grad():  # where DTensor.to_local() returns the shard itself, without autograd's bookkeeping
            held = [getattr(module, attribute) for module, attribute in self._where]
            return [t.to_local() if hasattr(t, "to_local") else t for t in held]

    def moved(self, local: list[torch.Tensor]) -> list[tuple] | None:
        """Return where the tensors are now if any moved since their handles were exported, else None.

        A module may hold another tensor, as FSDP2 does during a forward, or the same tensor in new storage, as
        FSDP2 does for the parameters it gathers; either moves it."""
        where = [(t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in local]
        return where if self._exported is None or self._exported[0] != where else None

    def gather(self) -> None:
        """Synchronize this rank's GPU and share its handles with every rank; all ranks call it at once.

        A tensor's handle is exported again only if the tensor moved."""
        from torch.multiprocessing.reductions import reduce_tensor

        local = self.local_tensors()
        if (where := self.moved(local)) is not None:
            handles = [(n, reduce_tensor(t.detach())[1]) for n, t in zip(self.names, local, strict=True)]
            self._exported = (where, handles)
            self._gpu_uuid = str(torch.cuda.get_device_properties(local[0].device).uuid)
        torch.cuda.synchronize()  # the step's last writes, before rank 0 tells the engines to read
        mine = {self._gpu_uuid: self._exported[1]}
        self.gathered = {uuid: handles for rank in every_rank(mine) for uuid, handles in rank.items()}


def _local(param: torch.Tensor) -> torch.Tensor:
    """Return a parameter's own storage on this rank, its FSDP2 shard, detached."""
    return (param.to_local() if hasattr(param, "to_local") else param).detach()


class BF16Source(TrainerSource):
    """What vLLM's own loader receives: every tensor as `save_pretrained` would write it, in bf16.

    CheckpointForm gives each family's checkpoint names, persistent buffers such as a router's correction bias
    included, gathered one FSDP module at a time. A tensor transformers keeps in fp32 stays fp32. Names and
    shapes are worked out once, not per sync. `fresh` is passed to CheckpointForm."""

    def __init__(self, module: torch.nn.Module, exclude=(), fresh: bool = True) -> None:
        self._form = CheckpointForm(module, torch.bfloat16, exclude, fresh)
        split = vllm_load_form(module, self._form.metadata)  # where the installed vLLM wants other names
        self._metas = [ParamMeta(n, d, s) for meta in self._form.metadata for n, s, d in split.get(meta[0], [meta])]
        self._split = {name: [n for n, _, _ in parts] for name, parts in split.items()}
        # Where each tensor comes from, so that a check can read the model instead: (module, attribute, is a
        # rank's own block) if it is that model tensor cast, whole under FSDP2, followed by (expert, first row,
        # rows) if it is one expert's slice of it; else None.
        self.origins = [
            None
            if not origin or (meta[0] in split and len(origin) > 2)
            else (*origin[:2], False, (e, 0, meta[1][1]))
            if meta[0] in split  # its expert e, whole
            else (*origin[:2], False, *origin[2:])
            for meta, origin in zip(self._form.metadata, self._form.origins, strict=True)
            for e, _ in enumerate(split.get(meta[0], [meta]))
        ]

    def param_metas(self) -> list[ParamMeta]:
        return self._metas

    def tensors(self):
        for name, tensor in self._form:
            if name in self._split:  # one expert at a time
                yield from zip(self._split[name], tensor.unbind(0), strict=True)
            else:
                yield name, tensor


class LocalExpertSource(BF16Source):
    """What the direct loader receives from one rank: BF16Source's tensors, except the fused expert tensors.

    Of those, each rank sends its own FSDP shard without a gather, under the name of vLLM's expert layer from
    expert_block_names. FSDP2 shards dim 0, so rank r holds experts [r*E/N, (r+1)*E/N): the block that vLLM's
    linear expert placement gives the engine on rank r's GPU. Every rank yields the same names and shapes, as
    vLLM's packed IPC producer requires. Every rank builds its source at once, since the ranks agree which
    tensors can go in place (InPlace); those are yielded last. Its tensors are not fresh, in CheckpointForm's
    sense: the direct loader takes packed sends only, whose producer copies each tensor into its buffer before
    it takes the next."""

    def __init__(self, module: torch.nn.Module, world_size: int) -> None:
        if problem := direct_loader_problem(module, world_size):
            raise ValueError(problem)
        self._blocks = expert_block_names(module)  # in-memory name -> name sent
        self._params = dict(module.named_parameters())
        self.expert_blocks = {
            sent: (self._params[name].shape[0] // world_size, *self._params[name].shape[1:])
            for name, sent in self._blocks.items()
        }
        whole = _held_whole_as_sent(module, self._blocks)  # name -> (module, attribute, dtype sent)
        fits = InPlace.possible(
            {name: (_local(getattr(m, a)), dtype) for name, (m, a, dtype) in whole.items()}
            | {sent: (_local(self._params[name]), torch.bfloat16) for name, sent in self._blocks.items()}
        )
        in_place_whole = {name: where for name, where in whole.items() if fits[name]}
        experts_in_place = bool(self._blocks) and all(fits[sent] for sent in self._blocks.values())
        super().__init__(module, exclude={*self._blocks, *in_place_whole}, fresh=False)
        # After the form's tensors: each (name sent, its metadata, its origin, how to read it).
        blocks = [
            (
                sent,
                ParamMeta(sent, torch.bfloat16, self.expert_blocks[sent]),
                (module.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2], True),
                partial(_bf16_local, self._params[name]),
            )
            for name, sent in self._blocks.items()
        ]
        whole_part = [
            (name, ParamMeta(name, dtype, tuple(getattr(m, a).shape)), (m, a, False), partial(_read, m, a))
            for name, (m, a, dtype) in in_place_whole.items()
        ]
        # Those in place come last, so that weight_sender packs the rest.
        in_place = whole_part + (blocks if experts_in_place else [])
        self._tail = ([] if experts_in_place else blocks) + in_place
        self._metas += [meta for _, meta, _, _ in self._tail]
        self.origins += [origin for _, _, origin, _ in self._tail]
        self.in_place = InPlace({name: origin[:2] for name, _, origin, _ in in_place}) if in_place else None

    def tensors(self):
        yield from super().tensors()
        for name, _, _, read in self._tail:
            yield name, read()


def _held_whole_as_sent(model: torch.nn.Module, exclude) -> dict[str, tuple[torch.nn.Module, str, torch.dtype]]:
    """Map each tensor the checkpoint form sends as the model holds it, whole on this rank, to where it is.

    That is a tensor under its own name that transformers' conversion leaves alone and vLLM's loader takes as it
    is, not an FSDP2 shard of a larger one. The value is (module, attribute, the dtype it is sent in)."""
    form = CheckpointForm(model, torch.bfloat16, exclude)
    split = vllm_load_form(model, form.metadata)
    out = {}
    for group, unchanged, dtypes in zip(form._groups, form._unchanged, form._dtypes, strict=True):
        for name in group if unchanged else ():
            module, attribute = form._where[name]
            tensor = getattr(module, attribute)
            if name not in split and (not hasattr(tensor, "device_mesh") or _whole_shard(tensor)):
                out[name] = (module, attribute, dtypes[name])
    return out


def _bf16_local(param: torch.Tensor) -> torch.Tensor:
    """Return a parameter's own storage on this rank in bf16: itself if it is bf16, as the blocks in place are."""
    return _local(param).to(torch.bfloat16)


def _read(module: torch.nn.Module, attribute: str) -> torch.Tensor:
    """Return a model tensor's storage on this rank, read from its module now, as FSDP2 or a trainer may swap it."""
    return _local(getattr(module, attribute))


def direct_loader_problem(model: torch.nn.Module, world_size: int) -> str | None:
    """Return why the direct loader cannot sync this model over `world_size` GPUs, or None.

    It sends what vLLM's loader gets, the checkpoint form, except that each rank sends its own block of each
    fused expert tensor, which the server copies as it is into its own experts. So each fused expert tensor
    must be one the server knows, gate_up_proj or down_proj, in vLLM's layout [E, 2I, H] with the gate rows
    first, and its experts must split evenly over the GPUs."""
    from weight_sync.direct_load import EXPERT_TENSORS, USE_VLLMS_LOADER

    fix = f"; {USE_VLLMS_LOADER}"
    for name, layout in fused_expert_tensors(model).items():
        if name.rpartition(".")[2] not in EXPERT_TENSORS:
            return f"the direct loader copies fused {'/'.join(EXPERT_TENSORS)} experts only, not {name}{fix}"
        if layout["transposed"] or not layout["concatenated"]:
            return f"{name} is not in vLLM's fused expert layout (gate rows, then up rows){fix}"
        if layout["shape"][0] % world_size:
            return (
                f"{name} has {layout['shape'][0]} experts, which do not split evenly over "
                f"{world_size} GPUs as the direct loader needs{fix}"
            )
    return None
