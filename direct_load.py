"""The direct weight loader: the server side of rlhf_ipc_fsdp_ep.py's fast sync.

vLLM's own receive path (/update_weights) hands every tensor to the model's
`load_weights`, which loads a fused expert tensor one expert at a time through
vLLM's layer-wise reload wrappers: 48 layers x 128 experts x 3 projections of
Python calls per engine per sync on Qwen3-30B-A3B, non-local experts included.
On 2 H200 the server spends 26 of a sync's 27 s receiving; the same weights
through this loader take 0.75 s, so the time goes to those calls, not to the
copying (docs/BENCHMARKS.md).

This loader is a vLLM worker extension, loaded by the server with
`--worker-extension-cls direct_load.DirectLoadWorker` and driven through
`/collective_rpc`. It reads the same packed CUDA IPC buffer as vLLM's IPC
engine, but:
  * each engine receives only ITS experts: the trainer rank on the same GPU
    sends its own FSDP shard of each fused expert tensor, which under vLLM's
    linear expert placement is exactly the block of experts that engine holds
    (checked before the first send by `direct_load_check`, and again on
    every chunk; a mismatch is an error, never a silent mis-load);
  * a fused expert block arrives under `<vLLM expert layer>.gate_up_proj` or
    `.down_proj` (the trainer names it after the checkpoint's expert module,
    which is the name vLLM gives the layer, whatever the family) and is one
    copy into `w13_weight` / `w2_weight`; from a trainer that holds its
    experts in bf16, straight from the trainer's own memory (a CUDA IPC
    handle per block, opened once: `direct_load_start`), not through the
    packed buffer, so each expert weight is copied once per sync;
  * every other tensor arrives in checkpoint form (names, persistent buffers
    such as a router's correction bias) and goes through the model's own
    `load_weights` (which stacks q/k/v and so on) into the live parameters;
  * at the end, each layer that received weights runs its
    `process_weights_after_loading`, as vLLM's reload does.

It is written for unquantized models. `direct_load_fingerprint` lets a run
prove that it leaves every parameter bit-identical to vLLM's own path.

Call it between /sleep and /wake_up, as rlhf_ipc_fsdp_ep.py does: sleeping
pauses scheduling and clears the prefix cache, whose entries the old weights
computed.
"""

from __future__ import annotations

import base64
import math
import os
import pickle
import re
import time
from dataclasses import dataclass, field

import torch

from vllm_compat import local_expert_ids

try:  # vLLM's GPU builds depend on Triton; without it, the torch code fingerprints everything
    import triton
    import triton.language as tl
except ImportError:
    triton = None

EXPERT_TENSORS = {"gate_up_proj": "w13_weight", "down_proj": "w2_weight"}
_ONE_EXPERT = re.compile(r"\.experts\.(\d+)\.")  # one expert's tensor in checkpoint form: its id


@dataclass
class _Session:
    model: torch.nn.Module
    device: torch.device
    gpu_uuid: str
    expert_layers: dict[str, torch.nn.Module]  # vLLM layer name -> RoutedExperts
    param_owner: dict[str, torch.nn.Module]  # parameter name -> module holding it
    importer: object
    touched: dict[int, torch.nn.Module] = field(default_factory=dict)
    tensors: int = 0
    bytes: int = 0
    seconds: dict[str, float] = field(default_factory=dict)  # this engine's time in the chunks, by part


class DirectLoadWorker:
    """Mixed into vLLM's worker class; every method runs on every engine."""

    def direct_load_start(self, in_place: str = "") -> dict:
        """Start a sync. `in_place` (optional, base64 pickle): {"trainer_gpu_uuids": [...], "blocks":
        {GPU uuid: [(expert block name, CUDA IPC handle), ...]}}, handles of the trainer ranks' own
        storage of their expert blocks (ExpertsInPlace on the trainer, which has synchronized its GPU):
        this engine copies the block of the rank on its GPU straight from there, one copy each. The
        storage stays where it is between syncs, so each handle is opened once and kept."""
        from vllm.distributed.weight_transfer.packed_tensor import PackedBufferImporter

        start = time.perf_counter()
        if getattr(self, "_weight_update_active", False):
            raise RuntimeError("a vLLM weight update is active; finish it before a direct load")
        if (unfinished := getattr(self, "_direct_session", None)) is not None:
            unfinished.importer.close()  # a send that failed part way: start afresh
        model = self.model_runner.get_model()
        if getattr(self, "_direct_layout", (None,))[0] is not model:  # where everything is: found once
            self._direct_layout = (model, _expert_layers(model), _param_owners(model))
        session = self._direct_session = _session(*self._direct_layout, PackedBufferImporter())
        self._exact_started = None  # fingerprints of what the engine held before this sync: no longer of use
        if not in_place:
            return {"tensors": 0, "bytes": 0}
        update = _unpickle(in_place)
        blocks = update["blocks"].get(session.gpu_uuid) or _no_trainer_rank(session.gpu_uuid, list(update["blocks"]))
        tensors = self._trainer_storage(blocks, session.device)
        _load(session, tensors, update["trainer_gpu_uuids"].index(session.gpu_uuid), self.vllm_config)
        session.tensors += len(tensors)
        session.bytes += sum(t.numel() * t.element_size() for _, t in tensors)
        session.seconds["experts_in_place"] = time.perf_counter() - start  # (the copies are launched; finish waits)
        return {"tensors": len(tensors), "bytes": session.bytes}

    def _trainer_storage(self, blocks: list, device: torch.device) -> list[tuple[str, torch.Tensor]]:
        """The trainer's tensors behind `blocks`' CUDA IPC handles, each opened
        once and kept while the trainer sends the same handle (a handle the
        trainer no longer sends is closed: its tensor moved)."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        opened, kept = getattr(self, "_opened_storage", {}), {}
        out = []
        for name, handle in blocks:
            args = list(handle)
            args[6] = device.index  # the device index as this process numbers it
            key = tuple(args)
            kept[key] = opened[key] if key in opened else rebuild_cuda_tensor(*args)
            out.append((name, kept[key]))
        self._opened_storage = kept
        return out

    def direct_load_check(self, expected: str) -> dict:
        """Before any send: raise, naming the cause, unless this engine holds,
        for every expert block the trainer will send (`expected`: JSON of
        {"blocks": {name: [shape]}, "trainer_gpu_uuids": [...]}), a fused
        expert layer of that name whose local experts are exactly the block
        of the trainer rank on this engine's GPU, in that shape."""
        import json

        expected = json.loads(expected)
        model = self.model_runner.get_model()
        uuid = _gpu_uuid(next(model.parameters()).device)
        uuids = expected["trainer_gpu_uuids"]
        trainer_rank = uuids.index(uuid) if uuid in uuids else _no_trainer_rank(uuid, uuids)
        dtype = getattr(torch, expected["dtype"])
        layers = _expert_layers(model)
        sent_to = {name.rpartition(".")[0] for name in expected["blocks"]}
        if missed := sorted(set(layers) - sent_to):
            raise ValueError(f"this engine's fused expert layers {missed[:2]} would get no expert block; "
                             "use --weight-loader vllm")  # fmt: skip
        for name, shape in expected["blocks"].items():
            layer_name, _, tensor_name = name.rpartition(".")
            if layer_name not in layers or tensor_name not in EXPERT_TENSORS:
                raise ValueError(
                    f"the trainer will send expert block {name}, but this engine has no fused expert "
                    f"tensor of that name (its expert layers: {sorted(layers)[:2] or 'none'}; "
                    f"tensors {list(EXPERT_TENSORS)}); use --weight-loader vllm"
                )
            param = getattr(layers[layer_name], EXPERT_TENSORS[tensor_name])
            if problem := _block_problem(layers[layer_name], name, param, shape, dtype, trainer_rank):
                raise ValueError(problem)
        return {"expert_blocks": len(expected["blocks"]), "trainer_rank": trainer_rank}

    def direct_load_chunk(self, payload: str) -> dict:
        """Load one packed chunk. `payload`: base64 pickle of vLLM's IPC update
        info (names, dtype_names, shapes, tensor_sizes, ipc_handles) plus
        `trainer_gpu_uuids`, the GPU of each trainer rank in rank order."""
        from vllm.config import set_current_vllm_config
        from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor

        start = time.perf_counter()
        session = self._direct_session_or_raise()
        update = _unpickle(payload)
        handles = update["ipc_handles"]
        if session.gpu_uuid not in handles:
            _no_trainer_rank(session.gpu_uuid, list(handles))
        trainer_rank = update["trainer_gpu_uuids"].index(session.gpu_uuid)
        args = list(handles[session.gpu_uuid])
        args[6] = session.device.index  # the device index as this process numbers it
        sizes = update["tensor_sizes"]
        buffer = session.importer.rebuild(args)[: sum(sizes)]
        dtypes = [getattr(torch, name) for name in update["dtype_names"]]
        tensors = unpack_tensor(buffer, update["names"], update["shapes"], dtypes, sizes)

        experts_done, load_done = _load(session, tensors, trainer_rank, self.vllm_config)
        # The trainer refills this buffer as soon as we return: finish reading it.
        if session.device.type == "cuda":
            torch.cuda.synchronize(session.device)
        session.tensors += len(tensors)
        session.bytes += sum(sizes)
        # Where this engine's time went (the caller's clock also counts HTTP and
        # the RPC to every engine): the expert copies are launched before
        # load_weights and may finish in `sync_s`.
        seconds = {"unpack_and_experts": experts_done - start, "load_weights": load_done - experts_done,
                   "sync": time.perf_counter() - load_done}  # fmt: skip
        for part, value in seconds.items():
            session.seconds[part] = session.seconds.get(part, 0.0) + value
        return {"tensors": len(tensors), "bytes": sum(sizes), "seconds": seconds}

    def direct_load_finish(self) -> dict:
        """Process what the send wrote (`_finish`) and release the IPC buffer."""
        session = self._direct_session_or_raise()
        _finish(session, self.vllm_config)
        session.importer.close()
        self._direct_session = None
        # /collective_rpc returns DP rank 0's answer only: every engine says its own in the server log.
        dp_rank = self.vllm_config.parallel_config.data_parallel_rank
        print(f"[direct_load] DP rank {dp_rank}: {session.tensors} tensors, {session.bytes / 1e9:.2f} GB; seconds in "
              "the chunks: " + ", ".join(f"{k} {v:.3f}" for k, v in session.seconds.items()), flush=True)  # fmt: skip
        return {"tensors": session.tensors, "bytes": session.bytes, "layers_processed": len(session.touched)}

    def direct_load_layout(self) -> dict:
        """What the loader assumes about this engine: its fused expert layers,
        their shapes and the global ids of the experts it holds."""
        model = self.model_runner.get_model()
        layers = {}
        for name, experts in _expert_layers(model).items():
            ids = local_expert_ids(experts)
            layers[name] = {
                "w13_weight": list(experts.w13_weight.shape),
                "w2_weight": list(experts.w2_weight.shape),
                "local_experts": [ids[0], ids[-1] + 1] if ids else [],
                "transposed": bool(getattr(experts, "is_fused_checkpoint_transposed", False)),
            }
        return {"dp_rank": self.vllm_config.parallel_config.data_parallel_rank, "expert_layers": layers}

    def direct_load_fingerprint(self, action: str) -> dict:
        """'store': remember a fingerprint of every parameter. 'compare':
        fingerprint again and raise, naming them, if any parameter differs
        from the stored one (so a mismatch on any DP engine fails the call)."""
        model = self.model_runner.get_model()
        prints = {name: _fingerprint(p) for name, p in model.named_parameters()}
        dp_rank = self.vllm_config.parallel_config.data_parallel_rank
        if action == "store":
            self._direct_reference = prints
            return {"dp_rank": dp_rank, "parameters": len(prints)}
        if action != "compare":
            raise ValueError(f"action must be 'store' or 'compare', not {action!r}")
        reference = getattr(self, "_direct_reference", None)
        if reference is None:
            raise RuntimeError("no stored fingerprint: call with 'store' first")
        differ = sorted(n for n in reference.keys() | prints.keys() if reference.get(n) != prints.get(n))
        if differ:
            raise RuntimeError(
                f"DP rank {dp_rank}: {len(differ)} of {len(reference)} parameters differ from "
                f"the stored fingerprint: {differ[:8]}"
            )
        return {"dp_rank": dp_rank, "parameters": len(reference), "differ": differ}

    def exact_check_prepare(self, sent: str) -> dict:
        """Learn which of this engine's parameters each tensor the trainer
        sends is written into (`exact_targets`; `sent`: JSON [[name, dtype,
        shape, is_expert_block], ...], the source's metadata in send order).
        Before a full sync: it leaves zeros where it probes, until the sync
        overwrites them."""
        import json

        model = self.model_runner.get_model()
        self._exact_targets, casts, self._exact_values_only, self._exact_whole = exact_targets(
            model, json.loads(sent), self.vllm_config)
        self._held_fingerprints, self._exact_started = HeldFingerprints(), None
        exact_fingerprints(p for _, p in model.named_parameters())  # Triton compiles its kernels now, not in a sync
        return {"tensors": len(self._exact_targets), "casts": casts, "values_only": self._exact_values_only,
                "parameters": len({t for ts in self._exact_targets for t in ts})}  # fmt: skip

    def exact_check_start(self) -> dict:
        """Start fingerprinting what this engine holds, after a sync, on a CUDA
        stream of its own, beside whatever it serves next; exact_check waits
        for it (or, if this was not called, fingerprints then)."""
        targets = self._exact_targets_or_raise()
        model = self.model_runner.get_model()
        params = dict(model.named_parameters())
        names = checked_parameters(model, targets)
        self._exact_started = self._held_fingerprints.start(params[n] for n in names)
        return {"parameters": len(names)}

    def exact_check(self, expected: str) -> dict:
        """Prove that this engine holds exactly what the trainer rank on its
        GPU sent (`exact_problems`; `expected`: JSON {gpu_uuid: [[plain,
        by_column, by_position], ...]} in the order exact_check_prepare was given). Raise,
        naming this DP engine and the parameters that differ, if any does."""
        import json
        import time

        start = time.perf_counter()
        started, self._exact_started = getattr(self, "_exact_started", None), None  # used once, or not at all
        targets = self._exact_targets_or_raise()
        model = self.model_runner.get_model()
        uuid = _gpu_uuid(next(model.parameters()).device)
        per_rank = json.loads(expected)
        sent = per_rank[uuid] if uuid in per_rank else _no_trainer_rank(uuid, list(per_rank))
        dp_rank = self.vllm_config.parallel_config.data_parallel_rank

        def fingerprints(tensors):  # those exact_check_start launched, of the same parameters; else now
            return started() if started is not None else self._held_fingerprints(tensors)

        checked, problems = exact_problems(model, targets, sent, self._exact_values_only, self._exact_whole,
                                           fingerprints)  # fmt: skip
        if problems:
            raise RuntimeError(f"exact check: DP engine {dp_rank}: {len(problems)} of {checked} parameters "
                               f"differ: " + "; ".join(problems[:4]))  # fmt: skip
        return {"dp_rank": dp_rank, "parameters": checked, "seconds": time.perf_counter() - start}

    def _exact_targets_or_raise(self) -> list[list[str]]:
        targets = getattr(self, "_exact_targets", None)
        if targets is None:
            raise RuntimeError("exact_check_prepare was not called")
        return targets

    def _direct_session_or_raise(self) -> _Session:
        session = getattr(self, "_direct_session", None)
        if session is None:
            raise RuntimeError("direct_load_start was not called")
        return session


def _session(model: torch.nn.Module, expert_layers: dict, param_owner: dict, importer) -> _Session:
    """A direct load's state on one engine: where every parameter and fused
    expert layer is, and the IPC importer its chunks are read through."""
    device = next(model.parameters()).device
    return _Session(model=model, device=device, gpu_uuid=_gpu_uuid(device), expert_layers=expert_layers,
                    param_owner=param_owner, importer=importer)  # fmt: skip


def _param_owners(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Each parameter's name -> the module that holds it."""
    return {f"{prefix}.{name}" if prefix else name: module for prefix, module in model.named_modules()
            for name, _ in module.named_parameters(recurse=False)}  # fmt: skip


def _finish(session: _Session, vllm_config) -> None:
    """Run each written layer's post-load processing, then the attention
    layers' (e.g. MLA's absorbed W_UK_T / W_UV, derived from kv_b_proj), as
    vLLM's reload does."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention import is_deferred_attention_layer

    with torch.no_grad():
        for module in session.touched.values():
            method = getattr(module, "quant_method", None)
            if method is None or not hasattr(method, "process_weights_after_loading"):
                continue
            if hasattr(module, "_already_called_process_weights_after_loading"):
                delattr(module, "_already_called_process_weights_after_loading")
            method.process_weights_after_loading(module)
        with set_current_vllm_config(vllm_config):  # as vLLM's finish_weight_update runs it
            for module in session.model.modules():
                if is_deferred_attention_layer(module):
                    module.process_weights_after_loading(vllm_config.model_config.dtype)
    if session.device.type == "cuda":
        torch.cuda.synchronize(session.device)


def _load(session: _Session, tensors, trainer_rank: int, vllm_config) -> tuple[float, float]:
    """Write one chunk's tensors into the engine's model: each expert block
    the trainer rank on this GPU sent, in one copy into its layer's fused
    parameter; the rest through the model's own `load_weights`. Records the
    layers written (for direct_load_finish); returns when the expert copies
    and the loads were launched (perf_counter)."""
    from vllm.config import set_current_vllm_config

    others = []
    with torch.no_grad():
        for name, tensor in tensors:
            layer_name, _, tensor_name = name.rpartition(".")
            experts = session.expert_layers.get(layer_name)
            if experts is not None and tensor_name in EXPERT_TENSORS:
                _copy_local_experts(experts, name, EXPERT_TENSORS[tensor_name], tensor, trainer_rank)
                session.touched[id(experts)] = experts
            else:
                others.append((name, tensor))
        experts_done = time.perf_counter()
        if others:
            with set_current_vllm_config(vllm_config):
                loaded = session.model.load_weights(others)
            for param_name in loaded or ():
                owner = session.param_owner.get(param_name)
                if owner is not None:
                    session.touched[id(owner)] = owner
    return experts_done, time.perf_counter()


def _gpu_uuid(device: torch.device) -> str:
    """The GPU's UUID, as the trainer ranks report theirs ("" off CUDA)."""
    return str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else ""


def _expert_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    return {m.layer_name: m for m in model.modules() if isinstance(m, RoutedExperts)}


def _no_trainer_rank(gpu_uuid: str, trainer_gpu_uuids: list[str]):
    raise ValueError(
        f"no trainer rank on this engine's GPU ({gpu_uuid or 'no GPU'}); the trainer ranks are on "
        f"{trainer_gpu_uuids}: every engine needs a trainer rank on its own GPU"
    )


def _block_problem(experts, name: str, param: torch.Tensor, shape, dtype, trainer_rank: int) -> str | None:
    """Why the trainer rank's block `name` (`shape`, `dtype`) is not exactly
    what this engine's expert layer holds in `param`, or None."""
    held = local_expert_ids(experts)
    n = shape[0]
    sent = list(range(trainer_rank * n, (trainer_rank + 1) * n))
    if not held or not sent:
        return f"{name}: this engine holds experts {held} and the trainer rank on its GPU sends {n}"
    if (
        held != sent
        or tuple(param.shape) != tuple(shape)
        or param.dtype != dtype
        or getattr(experts, "is_fused_checkpoint_transposed", False)
    ):
        return (
            f"{name}: this engine holds experts {held[0]}..{held[-1]} as {tuple(param.shape)} {param.dtype}, "
            f"but the trainer rank on its GPU sends experts {sent[0]}..{sent[-1]} as {tuple(shape)} {dtype}. "
            "The direct loader needs tensor parallel size 1, experts split evenly over the GPUs, and "
            "trainer rank r on the GPU of DP rank r; use --weight-loader vllm otherwise"
        )
    return None


def _copy_local_experts(experts, name: str, param_name: str, tensor: torch.Tensor, trainer_rank: int) -> None:
    """Copy the trainer rank's block of experts into the engine's fused
    parameter, after checking that it is the block this engine holds."""
    param = getattr(experts, param_name)
    if problem := _block_problem(experts, name, param, tuple(tensor.shape), tensor.dtype, trainer_rank):
        raise ValueError(problem)
    param.data.copy_(tensor)


def _unpickle(payload: str) -> dict:
    # The same rule as vLLM's IPC engine: pickled handles only when the server
    # was told to accept them (rlhf_ipc_fsdp_ep.py's server listens on a Unix
    # socket that only its user can reach; see colocated_sync.start_server).
    if os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION") != "1":
        raise ValueError("refusing to unpickle the update without VLLM_ALLOW_INSECURE_SERIALIZATION=1")
    return pickle.loads(base64.b64decode(payload))


_FINGERPRINT_CHUNK = 1 << 24  # elements per step: bounds the temporary memory


def _fingerprint(tensor: torch.Tensor) -> str:
    """A checksum of a tensor's shape, dtype and every element in its place
    (exact_fingerprint), computed on its device: for comparing an engine's
    parameters with themselves (direct_load_fingerprint)."""
    return f"{tuple(tensor.shape)}:{tensor.dtype}:{':'.join(map(str, exact_fingerprint(tensor)))}"


def exact_targets(model: torch.nn.Module, sent: list, vllm_config) -> tuple[list[list[str]], dict[int, str],
                                                                           list[str], list[str]]:  # fmt: skip
    """For each tensor the trainer sends ([name, dtype, shape, is an expert
    block of the direct loader], in send order), the parameters of `model` it
    is written into: found by loading it once, as zeros, through the model's
    own `load_weights` (whatever the family stacks or renames), or, for an
    expert block, its layer's fused parameter. One expert's tensor of an
    expert another engine holds is written nowhere here. Also {index: dtype}
    of the tensors vLLM holds in another dtype than they are sent in (e.g. a router kept in
    fp32): the trainer fingerprints those cast, as vLLM's loader casts them;
    the parameters to compare by value alone (_relaid_out); and those written
    whole from one tensor of their shape, compared element by element."""
    from vllm.config import set_current_vllm_config

    device = next(model.parameters()).device
    layers = _expert_layers(model)  # by vLLM's layer name
    where = {id(module): prefix for prefix, module in model.named_modules()}  # the parameters' prefix
    by_prefix = {where[id(layer)]: layer for layer in layers.values()}
    targets = []
    with torch.no_grad(), set_current_vllm_config(vllm_config):
        for name, dtype, shape, block in sent:
            if block:
                layer_name, _, tensor_name = name.rpartition(".")
                targets.append([f"{where[id(layers[layer_name])]}.{EXPERT_TENSORS[tensor_name]}"])
                continue
            zeros = torch.zeros(shape, dtype=getattr(torch, dtype), device=device)
            loaded = sorted(model.load_weights([(name, zeros)]) or ())
            targets.append([t for t in loaded if not _held_elsewhere(name, by_prefix.get(t.rpartition(".")[0]))])
    params = dict(model.named_parameters())
    casts = {}
    for index, ((_, dtype, _, _), names) in enumerate(zip(sent, targets, strict=True)):
        held = {str(params[n].dtype).removeprefix("torch.") for n in names if n in params}
        if held and held != {dtype}:
            casts[index] = held.pop()
    pieces: dict[str, list[int]] = {}
    for index, names in enumerate(targets):
        for n in names:
            pieces.setdefault(n, []).append(index)
    whole = sorted(n for n, idx in pieces.items() if len(idx) == 1 and n in params
                   and tuple(sent[idx[0]][2]) == tuple(params[n].shape))  # fmt: skip
    return targets, casts, _relaid_out(sent, targets, by_prefix), whole


def _relaid_out(sent: list, targets: list[list[str]], by_prefix: dict) -> list[str]:
    """The fused-expert parameters vLLM's own loader fills from a FUSED
    checkpoint tensor, or from GPT-OSS's per-expert tensors: it lays those
    out its own way (GPT-OSS: [E, H, 2I] transposed), so only their values
    can be compared. The direct loader's blocks it copies as they are, and
    other families' per-expert tensors it stacks: those are compared whole."""
    out = set()
    for (name, _, _, block), names in zip(sent, targets, strict=True):
        gpt_oss_expert = re.search(r"\.experts\.\d+\.w(13|2)_(weight|bias)$", name)  # vLLM transposes those
        if block or (_ONE_EXPERT.search(name) and not gpt_oss_expert):
            continue
        out |= {t for t in names if t.rpartition(".")[0] in by_prefix}
    return sorted(out)


def as_held(tensors, casts: dict):
    """The tensors the trainer sends, each cast to the dtype vLLM holds it in
    where that differs (`casts`, from exact_targets): what to fingerprint."""
    for index, (_, tensor) in enumerate(tensors):
        yield held_as(tensor, casts.get(index))


def held_as(tensor: torch.Tensor, dtype: str | None) -> torch.Tensor:
    """`tensor` in the dtype vLLM holds it in (`dtype`, a torch dtype's name; None: its own)."""
    return tensor.to(getattr(torch, dtype)) if dtype else tensor


def exact_problems(model: torch.nn.Module, targets: list[list[str]], sent: list[list[int]],
                   values_only=(), whole=(), fingerprints=None) -> tuple[int, list[str]]:  # fmt: skip
    """(parameters checked, what is wrong with them): each parameter's
    fingerprint against the sum of those of the tensors written into it
    (`sent`: the trainer's exact_fingerprint of each, in `targets`' order);
    for those in `values_only` (exact_targets), their values alone; for
    those in `whole`, every element in its place. `fingerprints` takes the
    parameters' (exact_fingerprints, or a HeldFingerprints)."""
    if len(sent) != len(targets):
        raise ValueError(f"{len(sent)} fingerprints for the {len(targets)} tensors exact_check_prepare was given")
    want: dict[str, list[int]] = {}
    for sums, names in zip(sent, targets, strict=True):
        for name in names:  # a stacked parameter's fingerprint is the sum of its pieces'
            total = want.setdefault(name, [0, 0, 0])
            want[name] = [(a + b) % FINGERPRINT_MODULUS for a, b in zip(total, sums, strict=True)]
    params = dict(model.named_parameters())
    derived, values_only, whole = set(derived_parameters(model)), set(values_only), set(whole)
    checked = checked_parameters(model, targets)
    held = dict(zip(checked, (fingerprints or exact_fingerprints)([params[n] for n in checked]), strict=True))
    problems = []
    for name in params:
        if name not in want and name not in derived:
            problems.append(f"{name}: no tensor the trainer sends is written into it")
        elif name not in want:
            continue
        elif name in values_only and held[name][0] == want[name][0]:
            continue
        elif held[name][:2] != want[name][:2] or (name in whole and held[name][2] != want[name][2]):
            problems.append(f"{name}: " + ("the values sent, in another layout (transposed or permuted)"
                                           if held[name][0] == want[name][0] else "not what the trainer sent"))  # fmt: skip
    return len(params), problems


def checked_parameters(model: torch.nn.Module, targets: list[list[str]]) -> list[str]:
    """The parameters exact_problems fingerprints: those a sent tensor is
    written into (one that none is, it names without a fingerprint)."""
    written = {n for names in targets for n in names}
    return [n for n, _ in model.named_parameters() if n in written]


def derived_parameters(model: torch.nn.Module) -> list[str]:
    """Parameters no sent tensor writes, which vLLM computes from others after
    loading: those of attention layers that process their weights after the
    load (MLA's absorbed W_UK_T and W_UV, from kv_b_proj; direct_load_finish
    runs that processing, as vLLM's loader does). The exact check proves
    their sources; the logprob gate, their use."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer

    return [f"{prefix}.{name}" for prefix, module in model.named_modules() if is_deferred_attention_layer(module)
            for name, _ in module.named_parameters(recurse=False)]  # fmt: skip


def _held_elsewhere(sent_name: str, experts: torch.nn.Module | None) -> bool:
    """Whether `sent_name`, written into a parameter of the fused expert
    layer `experts` (None: of no expert layer), is one expert's tensor
    (checkpoint form, `...experts.<id>....`) of an expert another engine
    holds: vLLM's loader skips those, so they add nothing here."""
    found = _ONE_EXPERT.search(sent_name)
    return experts is not None and found is not None and int(found.group(1)) not in local_expert_ids(experts)


# The exact check's fingerprint: every element's bits through a fixed 32-bit
# mix (lowbias32), summed. Three sums: `plain` sums the mixed bits alone, so it
# does not depend on where an element sits and survives what vLLM's loader
# does to the trainer's tensors: stacking (q/k/v into qkv_proj, gate/up,
# experts into one fused tensor), splitting by expert, concatenating biases;
# `by_column` weighs each mixed element by an odd number drawn from its column
# (its index along the last dim, which stacking on dim 0 keeps), so a
# transposed tensor differs too; `by_position` weighs it by one drawn from its
# row as well, for a parameter written whole from one tensor of its shape (rows
# swapped or reversed differ). One mix per element (the weights are one
# multiplication each): the GPU kernel runs at about half the memory's speed.
# Integer arithmetic: the trainer's GPU, an engine's GPU and a CPU give the
# same sums.
FINGERPRINT_MODULUS = 1 << 62
_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 of int64 values below 2**32 (products wrap; the low 32 bits are exact)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def exact_fingerprints(tensors) -> list[list[int]]:
    """exact_fingerprint of each tensor, waiting for the device once."""
    sums = exact_fingerprint_sums(tensors)
    return torch.stack(sums).cpu().tolist() if sums else []


class HeldFingerprints:
    """exact_fingerprints of tensors that stay where they are between syncs
    (an engine's parameters; a trainer's), from a CUDA graph that replays
    every kernel launch at once: a model of hundreds of tensors spends more
    time launching the few small kernels each one needs than the GPU spends
    in them. The graph reads the tensors where they were when it was
    captured: it is captured once the same tensors, at the same addresses,
    come twice in a row (a loader that allocates new ones is fingerprinted
    eagerly), and captured again once moved tensors come twice in a row.
    Each tensor may be cast first (`casts`: dtypes to cast it through, in
    order) and be a shard starting at a row of a larger tensor
    (`row_offsets`, _fingerprint_sums); a call with a tensor that needs a
    cast or a contiguous copy runs eagerly, since a graph would keep those
    copies' memory for as long as it lives. `start` runs them on a
    CUDA stream of their own, beside whatever the process does next, and
    returns what waits for them."""

    def __init__(self) -> None:
        self._last = None  # the previous call's tensors: (address, shape, stride, dtype, offset) each
        self._graph = self._sums = self._stream = None

    def __call__(self, tensors, row_offsets=None, casts=None) -> list[list[int]]:
        return self.start(tensors, row_offsets, casts)()

    def start(self, tensors, row_offsets=None, casts=None):
        """Launch the fingerprints; returns a function that waits for them and reads them back."""
        tensors = list(tensors)
        row_offsets = list(row_offsets or [0] * len(tensors))
        casts = [tuple(c) for c in (casts or [()] * len(tensors))]

        def sums() -> torch.Tensor:
            out = []
            for tensor, offset, dtypes in zip(tensors, row_offsets, casts, strict=True):
                for dtype in dtypes:
                    tensor = tensor.to(dtype)
                out.append(_fingerprint_sums(tensor, offset))
            return torch.stack(out)

        if not tensors or not all(t.is_cuda for t in tensors):
            done = sums().tolist() if tensors else []
            return lambda: done
        graphed = not any(casts) and all(t.is_contiguous() for t in tensors)
        key = [(t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, o)
               for t, o in zip(tensors, row_offsets, strict=True)] if graphed else None  # fmt: skip
        self._stream = self._stream or torch.cuda.Stream(tensors[0].device)
        if key is None or key != self._last:  # new tensors (or ones a graph should not hold): eagerly
            self._last, self._graph, self._sums = key, None, None
        elif self._graph is None:  # the same tensors a second time: capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            # Not torch.cuda.graph(): it empties PyTorch's cache first, and the
            # trainer would allocate its 4 GiB send buffer again next sync.
            # ("thread_local": vLLM's own threads may use CUDA meanwhile.)
            with torch.cuda.stream(self._stream):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    captured = sums()
                finally:
                    graph.capture_end()
            self._graph, self._sums = graph, captured
        self._stream.wait_stream(torch.cuda.current_stream(tensors[0].device))  # what wrote them first
        with torch.cuda.stream(self._stream):
            if self._graph is not None:
                self._graph.replay()
                out = self._sums
            else:
                out = sums()
            ready = torch.cuda.Event()
            ready.record(self._stream)

        def result() -> list[list[int]]:
            ready.synchronize()
            return out.cpu().tolist()

        return result


def exact_fingerprint_sums(tensors) -> list[torch.Tensor]:
    """exact_fingerprint of each tensor as an int64 tensor of 3 on its device, not waited for."""
    return [_fingerprint_sums(t) for t in tensors]


def exact_fingerprint(tensor: torch.Tensor) -> list[int]:
    """[plain, by_column, by_position] of a tensor's elements (see above),
    each modulo FINGERPRINT_MODULUS, so the first two of a stack of tensors
    are the sums of theirs."""
    return _fingerprint_sums(tensor).tolist()


@torch.no_grad()
def _fingerprint_sums(tensor: torch.Tensor, row_offset: int = 0) -> torch.Tensor:
    """exact_fingerprint as an int64 tensor of 3 on the tensor's device: on a
    GPU, for 2- and 4-byte elements, in one pass of one kernel
    (_fingerprint_kernel); else with torch, in pieces of bounded size.
    `row_offset`: where the tensor's first row sits in a tensor it is a
    shard of (dim 0), so that the shards' sums add up to the whole's."""
    if triton is not None and tensor.is_cuda and tensor.element_size() in (2, 4) and tensor.numel():
        return fingerprint_sums_triton(tensor, row_offset=row_offset)
    flat = tensor.detach()
    columns = _columns(flat)
    rows = flat.contiguous().reshape(-1, columns)
    bits_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[rows.element_size()]
    unsigned = (1 << (8 * rows.element_size())) - 1 if rows.element_size() < 8 else -1
    column_weight = _weights(torch.arange(columns, device=rows.device), 0x9E3779B9) if columns > 1 else 1
    sums = torch.zeros(3, dtype=torch.int64, device=rows.device)
    step = max(1, _FINGERPRINT_CHUNK // columns)
    for start in range(0, rows.shape[0], step):
        bits = rows[start : start + step].view(bits_dtype).to(torch.int64) & unsigned
        if rows.element_size() == 8:  # fold 64-bit patterns into 32
            bits = (bits ^ (bits >> 32)) & _MASK32
        plain = _mix32(bits ^ 0x5BD1E995)  # (the constant: so that zeros count too)
        by_column = (plain * column_weight) & _MASK32
        first = _first_row(tensor, row_offset) + start
        row_weight = _weights(torch.arange(first, first + bits.shape[0], device=rows.device), 0x27D4EB2F)
        sums[0] += plain.sum() % FINGERPRINT_MODULUS
        sums[1] += by_column.sum() % FINGERPRINT_MODULUS
        sums[2] += ((by_column * row_weight[:, None]) & _MASK32).sum() % FINGERPRINT_MODULUS
        sums %= FINGERPRINT_MODULUS
    return sums


def _weights(index: torch.Tensor, seed: int) -> torch.Tensor:
    """The odd 32-bit weight of each column (or row) `index` (int64 on the device)."""
    return _mix32((index.to(torch.int64) + seed) & _MASK32) | 1


def _first_row(tensor: torch.Tensor, row_offset: int) -> int:
    """The fingerprint's row (the tensor seen as [rows, columns]) of the first
    element of a shard that starts at `row_offset` on dim 0 of the whole."""
    return row_offset * math.prod(tensor.shape[1:-1]) if tensor.dim() >= 2 else row_offset


def _columns(tensor: torch.Tensor) -> int:
    """The fingerprint's columns: the last dim's size (1 for a 1-D or empty-last-dim tensor)."""
    return tensor.shape[-1] if tensor.dim() >= 2 and tensor.shape[-1] > 0 else 1


def fingerprint_sums_triton(tensor: torch.Tensor, block: int = 8192, row_offset: int = 0) -> torch.Tensor:
    """_fingerprint_sums in one Triton kernel: each program mixes a tile of
    `block` elements (rows by columns of the tensor seen as [rows, columns];
    `block` a power of 2) the way the torch code does, with the same 32-bit
    arithmetic, and writes its three partial sums; torch adds them up. Reads
    the tensor once. A 2-D grid gives each element its row and column
    without a division. (On CPU only under
    TRITON_INTERPRET=1, as the tests run it against the torch code.)"""
    flat = tensor.detach().contiguous().reshape(-1)
    columns = _columns(tensor)
    rows = flat.numel() // columns
    bits = flat.view(torch.int16 if flat.element_size() == 2 else torch.int32)
    block_c = min(triton.next_power_of_2(columns), block)
    block_r = block // block_c
    grid = (triton.cdiv(rows, block_r), triton.cdiv(columns, block_c))
    partial = torch.empty(grid[0] * grid[1], 3, dtype=torch.int64, device=flat.device)
    _fingerprint_kernel[grid](bits, partial, rows, columns, _first_row(tensor, row_offset),
                              ELEMENT_BITS=8 * flat.element_size(), SALTED=columns > 1, BLOCK_R=block_r,
                              BLOCK_C=block_c)  # fmt: skip
    return partial.sum(0) % FINGERPRINT_MODULUS  # (int64 sums wrap modulo 2**64, a multiple of the modulus)


if triton is not None:  # the fingerprint's kernel (fingerprint_sums_triton)

    @triton.jit
    def _mix32_triton(x):  # lowbias32 on uint32 (its products wrap, as `& _MASK32` does in _mix32)
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x846CA68B
        return x ^ (x >> 16)

    @triton.jit
    def _fingerprint_kernel(bits_ptr, partial_ptr, rows, columns, first_row, ELEMENT_BITS: tl.constexpr,
                            SALTED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):  # fmt: skip
        row = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
        column = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
        inside = (row < rows) & (column < columns)
        raw = tl.load(bits_ptr + row * columns + column, mask=inside, other=0)
        if ELEMENT_BITS == 16:
            bits = raw.to(tl.uint16, bitcast=True).to(tl.uint32)
        else:
            bits = raw.to(tl.uint32, bitcast=True)
        plain = _mix32_triton(bits ^ 0x5BD1E995)
        if SALTED:
            column_weight = _mix32_triton(column.to(tl.uint32) + 0x9E3779B9) | 1
        else:
            column_weight = tl.full([1, BLOCK_C], 1, dtype=tl.uint32)
        by_column = plain * column_weight
        by_position = by_column * (_mix32_triton((row + first_row).to(tl.uint32) + 0x27D4EB2F) | 1)
        zero = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.int64)
        at = partial_ptr + (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * 3
        tl.store(at + 0, tl.sum(tl.sum(tl.where(inside, plain.to(tl.int64), zero), axis=1), axis=0))
        tl.store(at + 1, tl.sum(tl.sum(tl.where(inside, by_column.to(tl.int64), zero), axis=1), axis=0))
        tl.store(at + 2, tl.sum(tl.sum(tl.where(inside, by_position.to(tl.int64), zero), axis=1), axis=0))
