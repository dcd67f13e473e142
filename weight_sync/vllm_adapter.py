# SPDX-License-Identifier: Apache-2.0
"""Every vLLM name the direct loader, its FP8 path and the exact check's engine half use beyond vLLM's public API.

vLLM's public weight-transfer API (the IPC trainer engine, its HTTP client, `WeightSource`, `ModuleSource`) is
all that vLLM's own loader path needs: helpers.py uses nothing else. The direct loader reaches further, into the
engine's model, and a newer vLLM may move what it reaches for. So each such name is listed here once, with what
it is for and the versions it was seen in, and `missing_internals()` checks, before any GPU work, that each is
there with the shape the code expects. The script then falls back to vLLM's own loader, naming what is missing.

This module is also where the tested vLLM versions differ, and nowhere else:

* The weight source. 0.32's IPC trainer engine iterates the source itself and declares `metadata()` a method;
  0.33 and later call `source.iter_full()` and read `source.metadata` as a `functools.cached_property`.
  `TrainerSource` is a `WeightSource` of either.
* The experts an engine holds: read from the expert map, which every tested version has (`local_expert_ids`).
* GPT-OSS's experts through vLLM's own loader. From 0.33 vLLM loads a reload layer by layer through each
  parameter's weight loader and takes each GPT-OSS expert alone (`...mlp.experts.<e>.w13_weight`); its fused
  expert tensors would stay unwritten. `vllm_load_form` renames them so where vLLM needs it.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

TESTED_VLLM_VERSIONS = ("0.32.0", "0.33.0", "0.34.0")


@dataclass(frozen=True)
class Internal:
    """One vLLM name used beyond the public API."""

    module: str
    name: str  # an attribute of `module`, or "Class.attribute" (a class's own, not one set on its instances)
    purpose: str
    seen_in: str
    parameters: tuple[str, ...] = ()  # the leading parameters a function must take, in order
    fp8_only: bool = False  # needed only with --rollout-dtype fp8


INTERNALS = (
    Internal(
        "vllm.distributed.weight_transfer.packed_tensor",
        "PackedBufferImporter",
        "open the trainer's packed CUDA IPC buffer once per send, as vLLM's IPC engine does",
        "0.32.0, 0.33.0, 0.34.0",
    ),
    Internal(
        "vllm.distributed.weight_transfer.packed_tensor",
        "unpack_tensor",
        "split a packed chunk into its tensors, as vLLM's IPC engine does",
        "0.32.0, 0.33.0, 0.34.0",
        ("packed_tensor", "names", "shapes", "dtypes", "tensor_sizes"),
    ),
    Internal(
        "vllm.model_executor.model_loader.utils",
        "process_weights_after_loading",
        "the post-load processing vLLM's loader runs once after a load; the first direct sync runs it too",
        "0.32.0, 0.33.0, 0.34.0",
        ("model", "model_config", "target_device"),
    ),
    Internal(
        "vllm.config",
        "set_current_vllm_config",
        "the config context vLLM's loaders and post-load processing expect",
        "0.32.0, 0.33.0, 0.34.0",
    ),
    Internal(
        "vllm.model_executor.layers.fused_moe.routed_experts",
        "RoutedExperts",
        "find the fused expert layers and their w13_weight / w2_weight",
        "0.32.0, 0.33.0, 0.34.0",
    ),
    Internal(
        "vllm.model_executor.layers.attention",
        "is_deferred_attention_layer",
        "attention layers that derive weights from others after a load (MLA's W_UK_T / W_UV)",
        "0.32.0, 0.33.0, 0.34.0",
        ("layer",),
    ),
    Internal(
        "vllm.model_executor.layers.quantization.base_config",
        "QuantizeMethodBase",
        "a layer's quantization method, whose post-load processing runs after its weights change",
        "0.32.0, 0.33.0, 0.34.0",
    ),
    Internal(
        "vllm.model_executor.layers.linear",
        "UnquantizedLinearMethod.process_weights_after_loading",
        "bf16 linear layers: on CUDA their post-load processing only picks a GEMM by shape, so a sync skips it",
        "0.32.0, 0.33.0, 0.34.0",
    ),
    Internal(
        "vllm.utils.deep_gemm",
        "per_block_cast_to_fp8",
        "vLLM's block-wise FP8 quantization, the reference the FP8 kernel is checked against",
        "0.32.0, 0.33.0, 0.34.0",
        ("x",),
        fp8_only=True,
    ),
)


def _resolve(internal: Internal):
    """The object `internal` names; raises ImportError or AttributeError where it is not there."""
    obj = importlib.import_module(internal.module)
    for part in internal.name.split("."):
        obj = getattr(obj, part)
    return obj


def internal_problem(internal: Internal) -> str | None:
    """Why `internal` is not usable in the installed vLLM, or None."""
    where = f"{internal.module}.{internal.name}"
    try:
        obj = _resolve(internal)
    except (ImportError, AttributeError) as e:
        return f"{where} is missing ({type(e).__name__}: {e})"
    if internal.parameters:
        try:
            names = tuple(inspect.signature(obj).parameters)[: len(internal.parameters)]
        except (TypeError, ValueError):
            return f"{where} has no signature to check"
        if names != internal.parameters:
            return f"{where} takes ({', '.join(names)}), not ({', '.join(internal.parameters)})"
    return None


def missing_internals(fp8: bool = False) -> list[str]:
    """What the direct loader needs from vLLM and the installed vLLM lacks, one line each (empty: nothing)."""
    return [p for i in INTERNALS if (fp8 or not i.fp8_only) and (p := internal_problem(i)) is not None]


def internal(module: str, name: str):
    """The vLLM object INTERNALS lists under `module` and `name`; raises naming it where it is missing."""
    entry = next((i for i in INTERNALS if i.module == module and i.name == name), None)
    if entry is None:
        raise KeyError(f"{module}.{name} is not listed in weight_sync/vllm_adapter.py's INTERNALS")
    return _resolve(entry)


# The post-load processing a sync can skip: a layer whose weights were written in place, in the layout they
# had, needs it again only where it derives something from them. These methods derive nothing on CUDA: a bf16
# linear layer picks its GEMM by the weight's shape, a bf16 expert layer on the Triton backend keeps its
# weights as they are. Anything else runs as vLLM runs it after a load, and so does an expert layer whose
# method names no backend.
_SKIPPED_POST_LOAD_BACKENDS = {"UnquantizedFusedMoEMethod": ("TRITON", "BATCHED_TRITON")}


def post_load_needed_again(module: torch.nn.Module) -> bool:
    """Whether `module`'s quantization method must process its weights again after they are rewritten in place."""
    from vllm.platforms import current_platform

    method = getattr(module, "quant_method", None)
    if method is None or not current_platform.is_cuda():
        return method is not None
    kind = type(method).__name__
    if kind == "UnquantizedLinearMethod":
        return False
    if kind in _SKIPPED_POST_LOAD_BACKENDS:
        backend = getattr(getattr(method, "unquantized_backend", None), "name", None)
        return backend not in _SKIPPED_POST_LOAD_BACKENDS[kind]
    return True


def run_post_load_hooks(model: torch.nn.Module, model_config, device: torch.device) -> None:
    """The modules' own post-load hooks, as vLLM's post-load function runs them after its quantization methods.

    0.34 runs every module's hook, children first (`finalize_model_weights`: attention layers, the MoE
    runner's fused gate, ...); 0.32 and 0.33 run the attention layers' hooks, which take the model's dtype,
    then the model's own.
    """
    weight_utils = importlib.import_module("vllm.model_executor.model_loader.weight_utils")
    finalize = getattr(weight_utils, "finalize_model_weights", None)
    if finalize is not None:
        finalize(model, device)
        return
    is_deferred = internal("vllm.model_executor.layers.attention", "is_deferred_attention_layer")
    for module in model.modules():
        if is_deferred(module):
            module.process_weights_after_loading(model_config.dtype)
    if hasattr(model, "process_weights_after_loading"):
        model.process_weights_after_loading()


class TrainerSource(WeightSource):
    """A trainer rank's weights as vLLM's IPC trainer engine takes them, on every tested vLLM.

    Subclasses implement `param_metas()` (name, dtype and shape of every tensor sent, the same on every rank,
    computed once) and `tensors()` (a fresh pass yielding `(name, tensor)` in that order). Every rank owns
    every tensor it sends, as the IPC engine requires.
    """

    def param_metas(self) -> list[ParamMeta]:
        raise NotImplementedError

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        raise NotImplementedError

    @cached_property
    def metadata(self) -> list[ParamMeta]:  # 0.33 and later read an attribute; 0.32 never calls it here
        return self.param_metas()

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:  # 0.33 and later
        return self.tensors()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:  # 0.32
        return self.tensors()


def local_expert_ids(experts: torch.nn.Module) -> list[int]:
    """The global ids of the experts a fused-MoE layer holds, in the order of its local slots.

    Without expert parallelism vLLM keeps no map: every expert, in order.
    """
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
    return (
        f"warning: vLLM {vllm.__version__} is installed; this example is tested on "
        f"{', '.join(TESTED_VLLM_VERSIONS[:-1])} and {TESTED_VLLM_VERSIONS[-1]} "
        "(requirements.txt pins the GPU version)"
    )


# GPT-OSS's fused expert tensors (transformers' names) -> vLLM's per-expert names.
_GPT_OSS_PER_EXPERT = {
    "gate_up_proj": "w13_weight",
    "gate_up_proj_bias": "w13_bias",
    "down_proj": "w2_weight",
    "down_proj_bias": "w2_bias",
}


def takes_gpt_oss_experts_one_by_one() -> bool:
    """Whether this vLLM's GPT-OSS loader takes each expert alone (0.33 and later)."""
    from vllm.model_executor.models import gpt_oss

    return hasattr(gpt_oss.GptOssModel, "_try_load_streamed_expert")


def vllm_load_form(model: torch.nn.Module, metadata: list[tuple]) -> dict[str, list[tuple]]:
    """What to send vLLM's loader instead of each (name, shape, dtype) of a checkpoint form, where it differs.

    GPT-OSS where vLLM takes each expert alone: each expert of a fused expert tensor under its own name.
    """
    # By the config: FSDP2's fully_shard renames the model's class (FSDPGptOssForCausalLM).
    if getattr(getattr(model, "config", None), "model_type", None) != "gpt_oss" or not (
        takes_gpt_oss_experts_one_by_one()
    ):
        return {}
    out = {}
    for name, shape, dtype in metadata:
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith(".mlp.experts") and leaf in _GPT_OSS_PER_EXPERT:
            out[name] = [
                (f"{prefix}.{e}.{_GPT_OSS_PER_EXPERT[leaf]}", tuple(shape[1:]), dtype) for e in range(shape[0])
            ]
    return out


def loader_choice(asked: str | None, fp8: bool = False, missing: Callable[[bool], list[str]] = missing_internals):
    """The loader a run uses and why: (loader, reason). `asked`: the --weight-loader flag, None if not given.

    Left to its default, the direct loader, unless the installed vLLM lacks an internal it needs: then vLLM's
    own loader, and the reason names what is missing. Asked for explicitly, the direct loader is refused
    (SystemExit) with that line instead.
    """
    if asked == "vllm":
        return "vllm", "asked for"
    problems = missing(fp8)
    if not problems:
        return "direct", "asked for" if asked == "direct" else "the default"
    line = f"the direct loader needs what this vLLM lacks: {problems[0]}" + (
        f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    )
    if asked == "direct":
        raise SystemExit(f"error: {line}; sync through vLLM's loader instead: --weight-loader vllm")
    return "vllm", f"{line}; syncing through vLLM's own loader instead"
