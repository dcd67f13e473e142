# SPDX-License-Identifier: Apache-2.0
"""List every vLLM name beyond the public API that this project reads, and what a vLLM without it gets.

vLLM's public API is taken here to be what vLLM's own RL examples (examples/rl/) use and what its
weight-transfer package exports, `PUBLIC_API`: `vllm`'s top level (`vllm.__version__`, LLM, SamplingParams),
the names `vllm.distributed.weight_transfer` lists in `__all__`, where they are defined (WeightSource,
ModuleSource and ParamMeta in `base`, WeightTransferTrainerFactory in `factory`, HTTPVLLMWeightSyncClient in
`clients`), the IPC engine's classes in `ipc_engine`, and the `vllm` command's modules (`vllm serve`). A member
of these whose name starts with an underscore is not public. vLLM's own loader path needs nothing else.
tests/test_vllm_adapter.py reads every module of the project and fails on a vLLM name that is neither public
nor listed here.

The direct loader and the exact check reach further, into the engine's model, and a newer vLLM may move what
they reach for. So each such name is listed here once, with its purpose, the versions that have it, who needs
it (`needed_by`: the direct loader, the exact check, or nothing when it is read with a default) and what a vLLM
without it gets (`if_absent`):

* `INTERNALS`: what a vLLM module defines. `missing_internals()` checks these before any GPU work, in the
  driver's interpreter, with the signature the code expects. The server's vLLM, on another node or in another
  environment, may differ, so each engine checks its own again at setup (DirectLoadWorker.direct_load_lacks),
  with `ATTRIBUTES`' needed ones too. Lacking one the direct loader needs, the default run syncs through
  vLLM's own loader and says so in one line (`loader_choice`); lacking one the exact check needs, the run has
  no exact check, and each round's line and JSON say why (`exact_check_choice`).
* `ATTRIBUTES`: what is read off the engine's objects, which exist only once it has built its model.

Everything that differs between the tested vLLM versions is in this module:

* The weight source. vLLM 0.32's IPC trainer engine iterates the source itself and declares `metadata()` a
  method; 0.33 and later call `source.iter_full()` and read `source.metadata` as a `functools.cached_property`.
  `TrainerSource` works with both.
* The experts an engine holds. `local_expert_ids` reads them from the expert map, which every tested version has.
* The modules' own post-load hooks. vLLM 0.34 runs every module's, children first; 0.32 and 0.33 run the
  attention layers', which take the model's dtype, then the model's own. `post_load_hooks` lists them.
* GPT-OSS's experts through vLLM's own loader. From 0.33, vLLM reloads layer by layer through each parameter's
  weight loader and takes each GPT-OSS expert on its own, as `...mlp.experts.<e>.w13_weight`, so fused expert
  tensors would stay unwritten. `vllm_load_form` renames them for the versions that need it.
"""

from __future__ import annotations

import base64
import functools
import importlib
import inspect
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

TESTED_VLLM_VERSIONS = ("0.32.0", "0.33.0", "0.34.0")

# vLLM's public API as this project reads it: each module, and the names in it that are public. A module with
# no names is public as a module, such as the one the `vllm` command runs.
PUBLIC_API = {
    "vllm": ("__version__", "LLM", "SamplingParams"),
    "vllm.distributed.weight_transfer": (
        "WeightSource",
        "ModuleSource",
        "ParamMeta",
        "WeightTransferTrainerFactory",
        "HTTPVLLMWeightSyncClient",
    ),
    "vllm.distributed.weight_transfer.base": ("WeightSource", "ModuleSource", "ParamMeta"),
    "vllm.distributed.weight_transfer.factory": ("WeightTransferTrainerFactory",),
    "vllm.distributed.weight_transfer.clients": ("HTTPVLLMWeightSyncClient",),
    "vllm.distributed.weight_transfer.ipc_engine": (
        "IPCTrainerInitInfo",
        "IPCTrainerWeightTransferEngine",
        "IPCWeightTransferEngine",
        "IPCWeightTransferInitInfo",
    ),
    "vllm.entrypoints.cli.main": (),  # what the `vllm` command runs
    "vllm.entrypoints.cli.serve": (),  # its `serve` command
}

# Who needs a listed name.
DIRECT_LOADER, EXACT_CHECK = "the direct loader", "the exact check"
_WITHOUT = {
    (DIRECT_LOADER,): "the default run syncs through vLLM's own loader, saying so; --weight-loader direct stops",
    (DIRECT_LOADER, EXACT_CHECK): "the default run syncs through vLLM's own loader, saying so, and has no exact "
    "check, each round saying why; --weight-loader direct stops",
}


@dataclass(frozen=True)
class Internal:
    """Describe one vLLM name used beyond the public API."""

    module: str
    name: str  # An attribute of `module`, or "Class.attribute" for one defined on the class itself.
    purpose: str
    seen_in: str
    parameters: tuple[str, ...] = ()  # The leading parameters a function must take, in order.
    fp8_only: bool = False  # Needed only with --rollout-dtype fp8.
    needed_from: str | None = None  # Needed only from this vLLM version on; earlier ones lack it.
    needed_by: tuple[str, ...] = (DIRECT_LOADER,)  # Empty: read with a default, `absent` says what then.
    absent: str = ""

    @property
    def if_absent(self) -> str:
        """Say what a vLLM without this name gets."""
        return self.absent or _WITHOUT[self.needed_by]


INTERNALS = (
    Internal(
        "vllm.distributed.weight_transfer.packed_tensor",
        "PackedBufferImporter",
        "open the trainer's packed CUDA IPC buffer once per send, as vLLM's IPC engine does",
        "0.32.0, 0.33.0, 0.34.0",
    ),
    Internal(
        "vllm.distributed.weight_transfer.packed_tensor",
        "PackedBufferImporter.rebuild",
        "map the buffer from the handle each chunk carries",
        "0.32.0, 0.33.0, 0.34.0",
        ("self", "list_args"),
    ),
    Internal(
        "vllm.distributed.weight_transfer.packed_tensor",
        "PackedBufferImporter.close",
        "release the mapping at the end of a send, or before a send starts afresh",
        "0.32.0, 0.33.0, 0.34.0",
        ("self",),
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
        "vllm.model_executor.model_loader.weight_utils",
        "finalize_model_weights",
        "the modules' own post-load hooks, which 0.34 runs after every load; post_load_hooks lists what it runs",
        "0.34.0",
        ("model", "target_device"),
        needed_from="0.34",
    ),
    Internal(
        "vllm.config",
        "set_current_vllm_config",
        "the config context vLLM's loaders and post-load processing expect",
        "0.32.0, 0.33.0, 0.34.0",
        needed_by=(DIRECT_LOADER, EXACT_CHECK),
    ),
    Internal(
        "vllm.model_executor.layers.fused_moe.routed_experts",
        "RoutedExperts",
        "find the fused expert layers and their w13_weight / w2_weight",
        "0.32.0, 0.33.0, 0.34.0",
        needed_by=(DIRECT_LOADER, EXACT_CHECK),
    ),
    Internal(
        "vllm.model_executor.layers.attention",
        "is_deferred_attention_layer",
        "attention layers that derive weights from others after a load (MLA's W_UK_T / W_UV); the exact check checks them",
        "0.32.0, 0.33.0, 0.34.0",
        ("layer",),
        needed_by=(DIRECT_LOADER, EXACT_CHECK),
    ),
    Internal(
        "vllm.model_executor.layers.quantization.base_config",
        "QuantizeMethodBase",
        "a layer's quantization method, whose post-load processing runs after its weights change, and whose "
        "layer's submodules have no post-load hook of their own",
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
    Internal(
        "vllm.platforms",
        "current_platform",
        "whether the engine runs on CUDA (post_load_needed_again), and each GPU's compute capability for "
        "--rollout-dtype fp8 (is_cuda, get_device_capability, device_count)",
        "0.32.0, 0.33.0, 0.34.0",
        needed_by=(),
        absent="the platform is taken as not CUDA: a later sync runs every written layer's post-load processing "
        "again; --rollout-dtype fp8 does not check the GPUs' FP8 support before starting",
    ),
    Internal(
        "vllm.model_executor.models.gpt_oss",
        "GptOssModel._try_load_streamed_expert",
        "whether vLLM's GPT-OSS loader takes each expert on its own (takes_gpt_oss_experts_one_by_one)",
        "0.32.0, 0.33.0, 0.34.0",
        needed_by=(),
        absent="GPT-OSS's experts are sent to vLLM's loader fused",
    ),
)


@dataclass(frozen=True)
class Attribute:
    """Describe one attribute of vLLM's objects read beyond the public API.

    These exist only once an engine has built its model. Each engine checks at setup those that `needed_by`
    names (engine_attribute_problems), and a vLLM without one gets what INTERNALS' needed ones get; every other
    is read with a default, and `if_absent` says what a vLLM without it gets."""

    owner: str
    name: str  # One attribute, a dotted path of them, or several joined by ", ".
    purpose: str
    seen_in: str
    absent: str = ""
    needed_by: tuple[str, ...] = ()

    @property
    def names(self) -> list[str]:
        return [n.strip() for n in self.name.split(",")]

    @property
    def if_absent(self) -> str:
        """Say what a vLLM without this attribute gets."""
        return self.absent or f"{_WITHOUT[self.needed_by]} (each engine checks at setup)"


ATTRIBUTES = (
    Attribute(
        "the GPU worker",
        "model_runner.get_model",
        "the engine's model, which the direct loader writes and the exact check reads",
        "0.32.0, 0.33.0, 0.34.0",
        needed_by=(DIRECT_LOADER, EXACT_CHECK),
    ),
    Attribute(
        "the GPU worker",
        "vllm_config.model_config, vllm_config.parallel_config.data_parallel_rank",
        "the config vLLM's loader and post-load processing take, and the engine's DP rank, which its answers "
        "and messages name",
        "0.32.0, 0.33.0, 0.34.0",
        needed_by=(DIRECT_LOADER, EXACT_CHECK),
    ),
    Attribute(
        "the GPU worker",
        "_weight_update_active",
        "refuse to start a direct load while vLLM's own weight update is open",
        "0.32.0, 0.33.0, 0.34.0",
        "no refusal",
    ),
    Attribute(
        "the engine's model",
        "load_weights",
        "vLLM's loader for what the direct loader does not copy itself, and the exact check's probes",
        "0.32.0, 0.33.0, 0.34.0",
        needed_by=(DIRECT_LOADER, EXACT_CHECK),
    ),
    Attribute(
        "a layer",
        "_already_called_process_weights_after_loading",
        "the one-shot guard on a quantization method's post-load processing, cleared so that a rewritten layer "
        "is processed again",
        "0.32.0, 0.33.0, 0.34.0",
        "the layer is not processed again: what its method derives from the weights stays as it was",
    ),
    Attribute(
        "a layer",
        "quant_method",
        "the layer's quantization method: its post-load processing, and an FP8 expert layer's kernel",
        "0.32.0, 0.33.0, 0.34.0",
        "no post-load processing runs for the layer after a later sync; FP8 experts are refused at setup, naming "
        "their backend as None",
    ),
    Attribute(
        "a fused expert layer",
        "layer_name",
        "the name the trainer sends an expert block under, and the exact check's name for the layer",
        "0.32.0, 0.33.0, 0.34.0",
        needed_by=(DIRECT_LOADER, EXACT_CHECK),
    ),
    Attribute(
        "a fused expert layer",
        "expert_map_manager.expert_map, expert_map_manager.global_num_experts",
        "the experts an engine holds (local_expert_ids)",
        "0.32.0, 0.33.0, 0.34.0",
        needed_by=(DIRECT_LOADER, EXACT_CHECK),
    ),
    Attribute(
        "a fused expert layer",
        "is_fused_checkpoint_transposed",
        "experts held transposed, which the direct loader refuses",
        "0.32.0, 0.33.0, 0.34.0",
        "taken as not transposed",
    ),
    Attribute(
        "a fused expert layer",
        "weight_block_size",
        "experts served in block-wise FP8 (fp8_scales)",
        "0.32.0, 0.33.0, 0.34.0",
        "FP8 experts are refused by the direct loader at setup, naming their dtype",
    ),
    Attribute(
        "a fused expert layer",
        "moe_config.w13_num_shards",
        "how many row blocks an FP8 expert weight stacks, each padded on its own (fp8_shards)",
        "0.32.0, 0.33.0, 0.34.0",
        "two: gate and up",
    ),
    Attribute(
        "an expert layer's quantization method",
        "unquantized_backend, fp8_backend, old_quant_method, moe_quant_config",
        "the MoE kernel's backend, and the scale tensors an FP8 kernel reads",
        "0.32.0, 0.33.0, 0.34.0",
        "post-load processing runs as vLLM runs it; FP8 experts are refused at setup, naming the backend; "
        "without moe_quant_config nothing is copied into the kernel's scale tensors",
    ),
    Attribute(
        "a parameter",
        "_vllm_is_uva_offloaded",
        "a weight offloaded through unified memory, which finalize_model_weights moves for the hooks",
        "0.32.0, 0.33.0, 0.34.0",
        "such a weight is taken as on the GPU",
    ),
)

# What each engine checks its ATTRIBUTES on, by owner.
ENGINE_OBJECTS = ("the GPU worker", "the engine's model", "a fused expert layer")


def _resolve(internal: Internal):
    """Return the object `internal` names; raise ImportError or AttributeError if it is not there."""
    obj = importlib.import_module(internal.module)
    for part in internal.name.split("."):
        if isinstance(obj, type) and part not in vars(obj):  # What a base class defines is not the same code.
            raise AttributeError(f"{obj.__name__} does not define {part} itself")
        obj = getattr(obj, part)
    return obj


def internal_problem(internal: Internal) -> str | None:
    """Say why `internal` is not usable in the installed vLLM, or return None."""
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


def missing_internals(fp8: bool = False, needed_by: str = DIRECT_LOADER) -> list[str]:
    """List what `needed_by` needs that the installed vLLM lacks, one line each; empty if nothing."""
    import vllm
    from packaging.version import Version

    installed = Version(Version(vllm.__version__).base_version)
    needed = [
        i
        for i in INTERNALS
        if needed_by in i.needed_by
        and (fp8 or not i.fp8_only)
        and (i.needed_from is None or installed >= Version(i.needed_from))
    ]
    return [p for i in needed if (p := internal_problem(i)) is not None]


_REQUIRED = object()


def internal(module: str, name: str, default=_REQUIRED):
    """Return the vLLM object INTERNALS lists under `module` and `name`.

    If the installed vLLM lacks it, return `default`, or raise, naming it, without one."""
    entry = next((i for i in INTERNALS if i.module == module and i.name == name), None)
    if entry is None:
        raise KeyError(f"{module}.{name} is not listed in weight_sync/vllm_adapter.py's INTERNALS")
    try:
        return _resolve(entry)
    except (ImportError, AttributeError):
        if default is _REQUIRED:
            raise
        return default


def engine_attribute_problems(worker, needed_by: str = DIRECT_LOADER) -> list[str]:
    """List what `needed_by` reads off this engine's objects (ATTRIBUTES) that they lack, one line each.

    `worker` is vLLM's worker with the direct loader's extension; its model, and the model's fused expert
    layers, are checked too once the worker has what reaches them."""
    objects: dict[str, list] = {"the GPU worker": [worker]}
    get_model = getattr(getattr(worker, "model_runner", None), "get_model", None)
    model = get_model() if callable(get_model) else None
    objects["the engine's model"] = [model] if model is not None else []
    experts = internal("vllm.model_executor.layers.fused_moe.routed_experts", "RoutedExperts", None)
    objects["a fused expert layer"] = (
        [m for m in model.modules() if isinstance(m, experts)] if model is not None and experts else []
    )
    problems = []
    for attribute in (a for a in ATTRIBUTES if needed_by in a.needed_by):
        for name in attribute.names:
            if any(not _has(obj, name) for obj in objects[attribute.owner]):
                problems.append(f"{attribute.owner}'s {name} is missing")
    return problems


def _has(obj, dotted: str) -> bool:
    for part in dotted.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def lacking(problems: list[str]) -> str:
    """Name the first of `problems` and count the rest, in one line."""
    return problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")


# An engine's list of what its vLLM lacks rides in its error message, encoded so that no quoting of the server's
# error reply can change it.
_LACKS_TOKEN = "engine-lacks="


def engine_lacks_error(where: str, needed_by: str, problems: list[str]) -> str:
    """Return the message an engine raises when `where`, its vLLM, lacks what `needed_by` needs (`problems`).

    engine_lacks reads it back."""
    line = lacking(problems)
    token = base64.urlsafe_b64encode(json.dumps([where, line]).encode()).decode()
    return f"{where} lacks what {needed_by} needs: {line} [{_LACKS_TOKEN}{token}]"


def raise_if_engine_lacks(worker, needed_by: str = DIRECT_LOADER, fp8: bool = False) -> None:
    """Raise engine_lacks_error's message if this engine's vLLM lacks what `needed_by` needs, in INTERNALS or
    in ATTRIBUTES; `worker` is vLLM's worker with the direct loader's extension."""
    problems = missing_internals(fp8, needed_by) + engine_attribute_problems(worker, needed_by)
    if problems:
        config = getattr(getattr(worker, "vllm_config", None), "parallel_config", None)
        rank = getattr(config, "data_parallel_rank", "?")
        raise RuntimeError(engine_lacks_error(f"DP engine {rank}'s vLLM", needed_by, problems))


def engine_lacks(error: str) -> tuple[str, str] | None:
    """Return (which engine's vLLM, what it lacks, in one line) from an error that carries engine_lacks_error's
    message, or None if it carries none."""
    found = re.search(re.escape(_LACKS_TOKEN) + r"([A-Za-z0-9_=-]+)", error)
    return tuple(json.loads(base64.urlsafe_b64decode(found[1]))) if found else None


# Quantization methods whose post-load processing a sync can skip. A layer whose weights were rewritten in
# place, in the same layout, needs that processing again only if it derives something from them. On CUDA these
# methods derive nothing: a bf16 linear layer picks its GEMM by the weight's shape, and a bf16 expert layer on
# the Triton backend keeps its weights as they are. Every other method runs again as vLLM runs it after a load,
# as does an expert layer whose method names no backend.
_SKIPPED_POST_LOAD_BACKENDS = {"UnquantizedFusedMoEMethod": ("TRITON", "BATCHED_TRITON")}


def post_load_needed_again(module: torch.nn.Module) -> bool:
    """Return whether `module`'s quantization method must process its weights again after an in-place rewrite."""
    platform = internal("vllm.platforms", "current_platform", None)
    method = getattr(module, "quant_method", None)
    if method is None or platform is None or not platform.is_cuda():
        return method is not None
    kind = type(method).__name__
    if kind == "UnquantizedLinearMethod":
        return False
    if kind in _SKIPPED_POST_LOAD_BACKENDS:
        backend = getattr(getattr(method, "unquantized_backend", None), "name", None)
        return backend not in _SKIPPED_POST_LOAD_BACKENDS[kind]
    return True


def post_load_hooks(model: torch.nn.Module, model_config, device: torch.device) -> list[Callable[[], None]]:
    """Return the modules' own post-load hooks, ready to call, in the order vLLM runs them after a load.

    They cover the attention layers (MLA derives W_UK_T and W_UV from kv_b_proj), the MoE runner's fused gate
    and others. vLLM finds them by walking the whole model after each load, and in a large MoE that walk over
    thousands of modules costs more than the hooks. The modules and their hooks stay the same from one sync to
    the next, so the direct loader walks once, after the first sync's full post-load processing, and keeps the
    list. vLLM 0.34's `finalize_model_weights` runs every module's hook, children first, except inside a
    quantized layer, whose method processed it; it moves weights offloaded to the CPU onto the GPU for the
    attention hooks, so with any weight offloaded the list is that function itself. vLLM 0.32 and 0.33 run
    the attention layers' hooks, then the model's own.
    """
    finalize = internal("vllm.model_executor.model_loader.weight_utils", "finalize_model_weights", None)  # 0.34 on
    if finalize is None:
        is_deferred = internal("vllm.model_executor.layers.attention", "is_deferred_attention_layer")
        hooks = [attention_post_load_hook(module, model_config) for module in model.modules() if is_deferred(module)]
        return hooks + (
            [model.process_weights_after_loading] if hasattr(model, "process_weights_after_loading") else []
        )
    if any(_moved_for_hooks(p, device) for p in model.parameters()):
        print(f"[direct_load] a weight is off {device}: each sync runs vLLM's finalize_model_weights", flush=True)
        return [functools.partial(finalize, model, device)]
    QuantizeMethodBase = internal("vllm.model_executor.layers.quantization.base_config", "QuantizeMethodBase")
    seen: set[torch.nn.Module] = set()

    def children_first(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
        quantized = isinstance(getattr(module, "quant_method", None), QuantizeMethodBase)
        for child in [] if quantized else module.children():
            if child not in seen:  # A module shared by several parents runs once, before all of them.
                seen.add(child)
                yield from children_first(child)
        yield module

    return [
        hook
        for module in children_first(model)
        if not isinstance(module, QuantizeMethodBase)
        and callable(hook := getattr(module, "process_weights_after_loading", None))
    ]


def _moved_for_hooks(param: torch.Tensor, device: torch.device) -> bool:
    """Return whether vLLM 0.34's finalize_model_weights moves `param` onto `device` for a hook: offloaded to
    the CPU, or through unified memory (`_vllm_is_uva_offloaded`). A placeholder on the meta device is not."""
    return (param.device.type == "cpu" and device.type != "cpu") or getattr(param, "_vllm_is_uva_offloaded", False)


def attention_post_load_hook(layer: torch.nn.Module, model_config) -> Callable[[], None]:
    """Return an attention layer's own post-load hook, ready to call.

    vLLM 0.34's takes no argument; 0.32's and 0.33's take the dtype the model computes in.
    """
    hook = layer.process_weights_after_loading
    return functools.partial(hook, model_config.dtype) if inspect.signature(hook).parameters else hook


class TrainerSource(WeightSource):
    """Give a trainer rank's weights to vLLM's IPC trainer engine, on every tested vLLM version.

    Subclasses implement `param_metas()` and `tensors()`. `param_metas()` returns the name, dtype and shape of
    every tensor sent; it is the same on every rank and computed once. `tensors()` is a fresh pass yielding
    `(name, tensor)` in that order. Every rank must own every tensor it sends, as the IPC engine requires.
    """

    def param_metas(self) -> list[ParamMeta]:
        raise NotImplementedError

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        raise NotImplementedError

    @cached_property
    def metadata(self) -> list[ParamMeta]:  # vLLM 0.33 and later read an attribute; 0.32 does not use it here.
        return self.param_metas()

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:  # vLLM 0.33 and later call this.
        return self.tensors()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:  # vLLM 0.32 iterates the source.
        return self.tensors()


def local_expert_ids(experts: torch.nn.Module) -> list[int]:
    """Return the global ids of the experts a fused-MoE layer holds, in the order of its local slots.

    Without expert parallelism vLLM keeps no map, and the layer holds every expert in order.
    """
    manager = experts.expert_map_manager
    expert_map = manager.expert_map  # Global id -> local slot, or -1 if another engine holds it.
    if expert_map is None:
        return list(range(manager.global_num_experts))
    held = torch.nonzero(expert_map >= 0).flatten()
    return held[torch.argsort(expert_map[held])].tolist()


def untested_vllm_warning() -> str | None:
    """Return a warning line if the installed vLLM is not a tested version, else None."""
    import vllm

    if vllm.__version__ in TESTED_VLLM_VERSIONS:
        return None
    return (
        f"warning: vLLM {vllm.__version__} is installed; this example is tested on "
        f"{', '.join(TESTED_VLLM_VERSIONS[:-1])} and {TESTED_VLLM_VERSIONS[-1]} "
        "(requirements.txt pins the GPU version)"
    )


# GPT-OSS's fused expert tensors, by their transformers names -> vLLM's per-expert names.
_GPT_OSS_PER_EXPERT = {
    "gate_up_proj": "w13_weight",
    "gate_up_proj_bias": "w13_bias",
    "down_proj": "w2_weight",
    "down_proj_bias": "w2_bias",
}


def takes_gpt_oss_experts_one_by_one() -> bool:
    """Return whether this vLLM's GPT-OSS loader takes each expert on its own, as 0.33 and later do."""
    return internal("vllm.model_executor.models.gpt_oss", "GptOssModel._try_load_streamed_expert", None) is not None


def vllm_load_form(model: torch.nn.Module, metadata: list[tuple]) -> dict[str, list[tuple]]:
    """Map each checkpoint-form (name, shape, dtype) to what vLLM's loader must get instead, where they differ.

    Only GPT-OSS differs, on vLLM versions that take each expert on its own: each expert of a fused expert
    tensor is sent under its own name.
    """
    # Check the config, not the class: FSDP2's fully_shard renames the class to FSDPGptOssForCausalLM.
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


def loader_choice(
    asked: str | None,
    fp8: bool = False,
    missing: Callable[[bool], list[str]] = missing_internals,
    where: str = "this vLLM",
):
    """Choose the loader for a run; return (loader, reason).

    `asked` is the --weight-loader flag, or None if not given. By default the direct loader is used, unless
    `where`, the installed vLLM or an engine's, lacks what it needs; then vLLM's own loader is used and the
    reason names what is missing. If the direct loader was asked for explicitly, a missing internal raises
    SystemExit instead.
    """
    if asked == "vllm":
        return "vllm", "asked for"
    problems = missing(fp8)
    if not problems:
        return "direct", "asked for" if asked == "direct" else "the default"
    line = f"{DIRECT_LOADER} needs what {where} lacks: {lacking(problems)}"
    if asked == "direct":
        raise SystemExit(f"error: {line}; sync through vLLM's loader instead: --weight-loader vllm")
    return "vllm", f"{line}; syncing through vLLM's own loader instead"


def exact_check_choice(
    fp8: bool = False, missing: Callable[..., list[str]] = missing_internals, where: str = "this vLLM"
) -> str | None:
    """Say why the run can have no exact check, because `where`, the installed vLLM or an engine's, lacks
    what it needs; return None if it lacks nothing."""
    problems = missing(fp8, needed_by=EXACT_CHECK)
    return f"{where} lacks what {EXACT_CHECK} needs: {lacking(problems)}" if problems else None


# vLLM 0.34 loads its weights with PyTorch's max_split_size_mb at 20 (VLLM_LOAD_SPLIT_MB). PyTorch puts each
# allocation of 1 to 10 MiB in a segment of large_segment_size_mb, 20 by default, and never again hands a free
# segment of max_split_size_mb or more to an allocation smaller than that. So each expert weight that vLLM quantizes
# to FP8 at its start leaves a 20 MiB segment behind in its sleep-mode pool until the load ends: by the code, 2.5 GiB
# a Moonlight-16B-A3B layer, 65 GiB in all (docs/FP8.md). Segments smaller than the split limit are used again.
VLLM_LOAD_SPLIT_MB = 20
FP8_START_SEGMENT_MB = 16  # above PyTorch's floor of 10, below VLLM_LOAD_SPLIT_MB
ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
ALLOC_CONF_READ = (ALLOC_CONF, "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # PyTorch parses the first one set


def serve_env(rollout_dtype: str = "bf16", environ: dict[str, str] | None = None) -> dict[str, str]:
    """Return the environment a `vllm serve` with serve_args(..., rollout_dtype=...) needs, for start_server's `env`.

    Pass it when the server's process starts, not to Server.serve(): PyTorch reads it once. With "fp8",
    PYTORCH_CUDA_ALLOC_CONF: the settings PyTorch would read from `environ` (os.environ by default) with
    large_segment_size_mb set to FP8_START_SEGMENT_MB; nothing for bf16."""
    if rollout_dtype != "fp8":
        return {}
    environ = os.environ if environ is None else environ
    current = next((environ[name] for name in ALLOC_CONF_READ if name in environ), "")
    kept = [
        f for f in (f.strip() for f in current.split(",")) if f and f.split(":")[0].strip() != "large_segment_size_mb"
    ]
    return {ALLOC_CONF: ",".join([*kept, f"large_segment_size_mb:{FP8_START_SEGMENT_MB}"])}
