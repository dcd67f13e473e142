# SPDX-License-Identifier: Apache-2.0
"""Load weights sent over CUDA IPC straight into a vLLM engine's parameters.

This is the server side of rlhf_ipc_fsdp_ep.py's fast sync. vLLM's own receive
path, /update_weights, hands every tensor to the model's `load_weights`, which
loads a fused expert tensor one expert at a time, non-local experts included:
Python calls per expert and projection, per engine and sync. On the
Moonlight-16B-A3B shape from a checkpoint, on one H200 (vLLM 0.34.0,
2026-12-05, commit 8ef489d), a sync takes 0.71-0.87 s through vLLM's fastest
mode of its own and 0.031-0.033 s through this loader; the README links the
JSON.

This loader is a vLLM worker extension. Start the server with
`--worker-extension-cls weight_sync.direct_load.DirectLoadWorker` and drive it
through `/collective_rpc`. It reads the same packed CUDA IPC buffer as vLLM's IPC
engine, with these differences:
  * Each engine receives only its own experts. The trainer rank on the same
    GPU sends its FSDP shard of each fused expert tensor, which under vLLM's
    linear expert placement is exactly the block of experts that engine
    holds. `direct_load_check` checks this before the first send, and every
    chunk checks it again; a mismatch raises rather than loading the wrong
    experts.
  * A fused expert block arrives as `<vLLM expert layer>.gate_up_proj` or
    `.down_proj` and is copied once into `w13_weight` or `w2_weight`. The
    trainer names it after the checkpoint's expert module, which is the name
    vLLM gives the layer in every model family.
  * Whatever the trainer rank holds as it is sent is copied straight from
    the trainer's memory through a CUDA IPC handle per tensor, opened once in
    `direct_load_start`, so each weight is copied once per sync: bf16 expert
    blocks, and on one GPU every tensor of a bf16 model, when nothing is
    packed. The rest arrives in vLLM's packed buffer.
  * Every other tensor arrives in checkpoint form, persistent buffers such
    as a router's correction bias included, and goes through the model's own
    `load_weights`, which stacks q/k/v and so on. The first time a name is
    sent, random tensors of its shape go through that loader alone to learn
    whether it writes the tensor unchanged into a block of rows of one
    parameter and nothing else. If it does, this loader copies the tensor
    there itself from then on, launching all such copies at once, because
    the loader's Python per tensor costs more than the copy. The names are
    learned when the trainer builds its sender (`direct_load_learn`), which
    puts back every weight the probes wrote, so a server that serves a
    checkpoint serves it unchanged until the first sync.
  * At the end of the first sync, vLLM's own post-load function,
    `process_weights_after_loading` of vLLM's model loader, runs over the
    model as it does after a load. Later syncs run only what must see the
    weights again: the modules' own hooks, listed once, and the quantization
    methods of the layers written that need it (`_finish`).

It supports bf16 models, and routed experts that vLLM serves in block-wise
FP8 with `--quantization-config '{"moe": "fp8_per_block"}'`. In that case
each expert block is quantized into vLLM's FP8 weight and scales as it is
written, which needs fp8_experts.py beside this file. The engine side of
the proof, proof/exact_check_engine.py, compares what each engine holds with
what the trainer sent; scripts/benchmark.py compares this loader's result
with vLLM's own loader's, parameter by parameter.

Call it between /sleep and /wake_up, as rlhf_ipc_fsdp_ep.py does: the sleep
pauses scheduling, and helpers.sleep_for_sync resets the prefix cache, whose
entries were computed with the old weights, before vLLM serves again.

vllm_adapter.py holds everything that differs between the vLLM versions this
example is tested on, 0.32, 0.33 and 0.34, including TrainerSource and
vllm_load_form on the trainer's side.
"""

from __future__ import annotations

import base64
import contextlib
import os
import pickle
import time
import zlib
from dataclasses import dataclass, field

import torch

from weight_sync.vllm_adapter import (  # noqa: F401  TrainerSource and untested_vllm_warning are re-exported
    DIRECT_LOADER,
    TESTED_VLLM_VERSIONS,
    TrainerSource,
    internal,
    local_expert_ids,
    post_load_hooks,
    post_load_needed_again,
    raise_if_engine_lacks,
    untested_vllm_warning,
    vllm_load_form,
)

EXPERT_TENSORS = {"gate_up_proj": "w13_weight", "down_proj": "w2_weight"}
# Every refusal suggests vLLM's own loader, which handles any layout.
USE_VLLMS_LOADER = 'sync through vLLM\'s loader instead (loader "vllm"; the script: --weight-loader vllm)'


@dataclass
class _Layout:
    """Hold where everything is in an engine's model, and what was learned about each sent name.

    It is found once because the parameters stay where they are across syncs.
    `plain` maps a sent name that vLLM's loader writes unchanged into a block
    of whole rows of one parameter to that parameter's name and first row;
    the direct loader copies those itself. `through_loader` holds the other
    names. Each name is learned on the first sync that sends it.
    """

    model: torch.nn.Module
    expert_layers: dict[str, torch.nn.Module]  # vLLM layer name -> RoutedExperts
    held_experts: dict[str, list[int]]  # vLLM layer name -> its local experts' global ids, fixed without EPLB
    param_owner: dict[str, torch.nn.Module]  # parameter name -> module holding it
    plain: dict[str, tuple[str, int]] = field(default_factory=dict)
    through_loader: set[str] = field(default_factory=set)
    processed: bool = False  # vLLM's post-load function has run over this model once, after a direct sync
    post_load_hooks: list = field(default_factory=list)  # the modules' own hooks, found once it has run
    # name -> (where its parameter is, _where(), and the rows a `plain` name is copied into).
    # Kept while the parameter's storage is unchanged, because slicing a vLLM parameter costs
    # more than the copy. If vLLM gives the parameter new storage, the kept view holds the old
    # storage alive until the next sync replaces it.
    views: dict[str, tuple] = field(default_factory=dict)


def _layout(model: torch.nn.Module) -> _Layout:
    experts = _expert_layers(model)
    return _Layout(
        model=model,
        expert_layers=experts,
        held_experts={name: local_expert_ids(layer) for name, layer in experts.items()},
        param_owner=_param_owners(model),
    )


@dataclass
class _Session:
    layout: _Layout
    importer: object
    device: torch.device
    gpu_uuid: str
    touched: dict[int, torch.nn.Module] = field(default_factory=dict)
    layers_post_loaded: int = 0  # written layers whose quantization method processed them again
    tensors: int = 0
    bytes: int = 0
    seconds: dict[str, float] = field(default_factory=dict)  # this engine's time in the chunks, by part
    copies_kept: bool | None = None  # whether the copies of the tensors in place were the last sync's


class DirectLoadWorker:
    """Mixed into vLLM's worker class; every method runs on every engine."""

    def direct_load_lacks(self, needed_by: str = DIRECT_LOADER, rollout_dtype: str = "bf16") -> list:
        """Check this engine's vLLM for what `needed_by` needs (vllm_adapter's INTERNALS and ATTRIBUTES).

        The driver checks its own vLLM before any GPU work, and this engine's may differ, on another node or in
        another environment: so the driver calls this on every engine once the server is healthy, before it
        sets up a transfer (sources.engines_lack). `needed_by` is "the direct loader" or "the exact check".
        /collective_rpc answers with the first DP engine's result alone, so an engine that lacks something
        raises, naming it, which fails the call whichever engine it is; otherwise it returns [].
        """
        raise_if_engine_lacks(self, needed_by, rollout_dtype == "fp8")
        return []

    def direct_load_start(self, in_place: str | dict = "") -> dict:
        """Start a sync; the send's first chunk calls this if the caller has not.

        `in_place` is optional: {"trainer_gpu_uuids": [...], "version": n, "tensors": {GPU uuid: [(name, CUDA IPC
        handle), ...]}}, as a base64 pickle over /collective_rpc or as the dict itself inside a chunk. The handles
        point at the trainer ranks' own storage of the tensors sent in place (sources.InPlace), shared after the
        trainer has synchronized its GPU. This engine copies the tensors of the rank on its GPU straight from
        there, one copy each. That storage stays where it is between syncs, so each handle is opened once and
        kept, and a send whose handles are unchanged carries only their version.
        """
        PackedBufferImporter = internal("vllm.distributed.weight_transfer.packed_tensor", "PackedBufferImporter")
        start = time.perf_counter()
        if getattr(self, "_weight_update_active", False):
            raise RuntimeError("a vLLM weight update is active; finish it before a direct load")
        if (unfinished := getattr(self, "_direct_session", None)) is not None:
            unfinished.importer.close()  # A send failed part way; start afresh.
        session = self._direct_session = _session(self._model_layout(), PackedBufferImporter())
        if not in_place:
            # Release trainer storage opened for an earlier sync.
            self._opened_storage, self._in_place, self._in_place_copies = {}, None, None
            return {"tensors": 0, "bytes": 0}
        update = _unpickle(in_place) if isinstance(in_place, str) else in_place
        tensors = self._in_place_tensors(update, session)
        # The same tensors as the last sync's, into parameters where they were: the same copies.
        kept = getattr(self, "_in_place_copies", None)
        copies = kept[1] if kept is not None and kept[0] is tensors and kept[1].unchanged() else None
        trainer_rank = update["trainer_gpu_uuids"].index(session.gpu_uuid)
        self._in_place_copies = (tensors, _load(session, tensors, trainer_rank, self.vllm_config, copies)[0])
        session.copies_kept = copies is not None
        session.tensors += len(tensors)
        session.bytes += sum(t.numel() * t.element_size() for _, t in tensors)
        # Copies are launched; finish waits for them. The key names the expert blocks; it times every tensor in place.
        seconds = {"experts_in_place": time.perf_counter() - start}
        session.seconds.update(seconds)
        return {"tensors": len(tensors), "bytes": session.bytes, "seconds": seconds}

    def _in_place_tensors(self, update: dict, session: _Session) -> list[tuple[str, torch.Tensor]]:
        """Return the trainer tensors this engine copies in place: opened from their handles, or kept from the
        last send that had the same version."""
        held = getattr(self, "_in_place", None)
        if "tensors" not in update:
            if held is None or held[0] != update["version"]:
                raise RuntimeError(
                    f"this engine holds no trainer handles of version {update['version']} (it holds "
                    f"{held[0] if held else 'none'}); the next send carries them all"
                )
            return held[1]
        handles = update["tensors"].get(session.gpu_uuid)
        if handles is None:
            _no_trainer_rank(session.gpu_uuid, list(update["tensors"]))
        self._in_place = None  # until every handle is open
        tensors = self._trainer_storage(handles, session.device)
        # The expert blocks first: the GPU starts on the bulk of the bytes while the loop goes over the rest.
        tensors.sort(key=lambda item: item[0].rpartition(".")[0] not in session.layout.expert_layers)
        self._in_place = (update["version"], tensors)
        return tensors

    def _trainer_storage(self, handles: list, device: torch.device) -> list[tuple[str, torch.Tensor]]:
        """Open the trainer tensors behind `handles`, [(name, CUDA IPC handle), ...].

        Each handle is opened once and kept while the trainer keeps sending it. A handle the trainer
        no longer sends is closed, because its tensor has moved.
        """
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        opened, kept = getattr(self, "_opened_storage", {}), {}
        out = []
        for name, handle in handles:
            args = list(handle)
            args[6] = device.index  # This process may number the GPU differently from the trainer.
            key = tuple(args)
            kept[key] = opened[key] if key in opened else rebuild_cuda_tensor(*args)
            out.append((name, kept[key]))
        self._opened_storage = kept
        return out

    def direct_load_check(self, expected: str) -> dict:
        """Check, before any send, that this engine can take every expert block the trainer will send.

        `expected` is JSON of {"blocks": {name: [shape]}, "trainer_gpu_uuids": [...], "dtype": ...}.
        Raise, naming the cause, unless each block has a fused expert layer of that name whose
        local experts are exactly the block of the trainer rank on this engine's GPU, in that shape.
        """
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
            raise ValueError(
                f"this engine's fused expert layers {missed[:2]} would get no expert block; {USE_VLLMS_LOADER}"
            )
        for name, shape in expected["blocks"].items():
            layer_name, _, tensor_name = name.rpartition(".")
            if layer_name not in layers or tensor_name not in EXPERT_TENSORS:
                raise ValueError(
                    f"the trainer will send expert block {name}, but this engine has no fused expert "
                    f"tensor of that name (its expert layers: {sorted(layers)[:2] or 'none'}; "
                    f"tensors {list(EXPERT_TENSORS)}); {USE_VLLMS_LOADER}"
                )
            param = getattr(layers[layer_name], EXPERT_TENSORS[tensor_name])
            if problem := _block_problem(layers[layer_name], name, param, shape, dtype, trainer_rank):
                raise ValueError(problem)
        warmed = set()  # FP8 experts: the kernel's compile and checks, here rather than in the first sync
        for name, shape in expected["blocks"].items():
            layer_name, _, tensor_name = name.rpartition(".")
            kind = (EXPERT_TENSORS[tensor_name], tuple(shape[1:]))
            if kind not in warmed and fp8_scales(layers[layer_name], kind[0]) is not None:
                _fp8_experts().fp8_warm_up(layers[layer_name], kind[0], shape)
                warmed.add(kind)
        return {"expert_blocks": len(expected["blocks"]), "trainer_rank": trainer_rank}

    def _model_layout(self) -> _Layout:
        """The engine's model's layout, found once per model and kept with what was learned there."""
        model = self.model_runner.get_model()
        if getattr(getattr(self, "_direct_layout", None), "model", None) is not model:
            self._direct_layout = _layout(model)
        return self._direct_layout

    def direct_load_learn(self, sent: str) -> dict:
        """Learn how vLLM's loader writes each non-expert tensor the trainer will send.

        `sent` is JSON of [[name, shape, dtype], ...]. Random probes of each shape go through the
        model's `load_weights`, as `_learn` does on a first sync, so the first sync copies at full
        speed. DirectLoadClient calls it when vLLM's IPC trainer engine is built, while the engine
        may be serving a checkpoint, so every weight the probes could write is put back after them
        (_put_back). A name that could write a fused expert weight is left to the first sync, which
        writes the real tensor after its probes.
        """
        import json

        start = time.perf_counter()
        layout, failed = self._model_layout(), {}
        device = next(layout.model.parameters()).device
        set_current_vllm_config = internal("vllm.config", "set_current_vllm_config")
        learn = [
            (name, shape, dtype)
            for name, shape, dtype in json.loads(sent)
            if name not in layout.plain and name not in layout.through_loader and not _in_fused_experts(layout, name)
        ]
        restored = {"tensors": 0, "bytes": 0, "seconds": 0.0}
        put_back = _put_back(layout, restored) if learn else contextlib.nullcontext()
        with torch.no_grad(), set_current_vllm_config(self.vllm_config), put_back:
            for name, shape, dtype in learn:
                try:
                    learned = _learn(layout, name, torch.empty(shape, dtype=getattr(torch, dtype), device=device))
                except Exception as e:  # The first sync probes it again and raises there if it must.
                    failed[name] = f"{type(e).__name__}: {e}"
                    continue
                if learned is None:
                    layout.through_loader.add(name)
                else:
                    layout.plain[name] = learned
        return {
            "plain": len(layout.plain),
            "through_loader": len(layout.through_loader),
            "not_learned": dict(list(failed.items())[:4]),  # The first sync probes each of these again.
            "restored": restored,
            "seconds": time.perf_counter() - start,
        }

    def direct_load_chunk(self, payload: str) -> dict:
        """Load one packed chunk.

        `payload` is a base64 pickle of vLLM's IPC update info (names, dtype_names, shapes,
        tensor_sizes, ipc_handles) plus `trainer_gpu_uuids`, the GPU of each trainer rank in rank
        order. The send's first chunk also carries `start`, the argument of direct_load_start,
        which this call runs first. The last chunk carries `last`: this call then also runs
        direct_load_finish and returns its answer under "finished". So a one-chunk send is one
        round trip.
        """
        unpack_tensor = internal("vllm.distributed.weight_transfer.packed_tensor", "unpack_tensor")
        update = _unpickle(payload)
        started = self.direct_load_start(update["start"]).get("seconds", {}) if "start" in update else {}
        start = time.perf_counter()
        session = self._direct_session_or_raise()
        handles, uuids = update["ipc_handles"], update["trainer_gpu_uuids"]
        sizes, tensors = update["tensor_sizes"], []
        trainer_rank = None  # A chunk without tensors has no buffer and no expert block.
        if sizes:
            if session.gpu_uuid not in handles:
                _no_trainer_rank(session.gpu_uuid, list(handles))
            trainer_rank = uuids.index(session.gpu_uuid)
            args = list(handles[session.gpu_uuid])
            args[6] = session.device.index  # This process may number the GPU differently from the trainer.
            buffer = session.importer.rebuild(args)[: sum(sizes)]
            dtypes = [getattr(torch, name) for name in update["dtype_names"]]
            tensors = unpack_tensor(buffer, update["names"], update["shapes"], dtypes, sizes)

        _, experts_done, load_done = _load(session, tensors, trainer_rank, self.vllm_config)
        # The trainer refills this buffer as soon as this returns, so finish reading it now.
        # After the last chunk, direct_load_finish waits for every copy instead.
        if session.device.type == "cuda" and not update.get("last"):
            torch.cuda.synchronize(session.device)
        session.tensors += len(tensors)
        session.bytes += sum(sizes)
        # This engine's own time; the caller's clock also counts HTTP and the RPC to every engine.
        # The expert copies are launched before load_weights and may finish during "sync".
        seconds = {
            "unpack_and_experts": experts_done - start,
            "load_weights": load_done - experts_done,
            "sync": time.perf_counter() - load_done,
        }
        for part, value in seconds.items():
            session.seconds[part] = session.seconds.get(part, 0.0) + value
        seconds = {**started, **seconds}  # direct_load_start already added its own to session.seconds.
        if not update.get("last"):
            return {"tensors": len(tensors), "bytes": sum(sizes), "seconds": seconds}
        finished = self.direct_load_finish()
        return {
            "tensors": len(tensors),
            "bytes": sum(sizes),
            "seconds": {**seconds, **finished.pop("seconds")},
            "finished": finished,
        }

    def direct_load_finish(self) -> dict:
        """Run post-load processing on what the send wrote and release the IPC buffer.

        The session ends even if the processing fails, so a retry starts afresh.
        """
        session = self._direct_session_or_raise()
        try:
            seconds = _finish(session, self.vllm_config)
        finally:
            launched = time.perf_counter()
            if session.device.type == "cuda":
                torch.cuda.synchronize(session.device)  # Stop reading the trainer's memory, even on error.
            session.importer.close()
            self._direct_session = None
        seconds["copies_done"] = time.perf_counter() - launched
        # /collective_rpc returns only DP rank 0's answer, so every engine logs its own.
        dp_rank = self.vllm_config.parallel_config.data_parallel_rank
        # Copies worked out again on a later sync mean vLLM moved a parameter the last ones wrote.
        copies = {None: "", True: "; in-place copies kept", False: "; in-place copies worked out"}[session.copies_kept]
        print(
            f"[direct_load] DP rank {dp_rank}: {session.tensors} tensors, {session.bytes / 1e9:.2f} GB{copies}; "
            "seconds in the chunks: " + ", ".join(f"{k} {v:.3f}" for k, v in session.seconds.items()),
            flush=True,
        )
        return {
            "tensors": session.tensors,
            "bytes": session.bytes,
            "layers_processed": len(session.touched),
            "layers_post_loaded": session.layers_post_loaded,
            "seconds": seconds,
        }

    def direct_load_layout(self) -> dict:
        """Return this engine's fused expert layers, their shapes and the global ids of its experts."""
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

    def _direct_session_or_raise(self) -> _Session:
        session = getattr(self, "_direct_session", None)
        if session is None:
            raise RuntimeError("direct_load_start was not called")
        return session


def _session(layout: _Layout, importer) -> _Session:
    """Create a direct load's state on one engine, around its model's layout and an IPC importer."""
    device = next(layout.model.parameters()).device
    return _Session(layout=layout, importer=importer, device=device, gpu_uuid=_gpu_uuid(device))


def _param_owners(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Map each parameter's name to the module that holds it."""
    return {
        f"{prefix}.{name}" if prefix else name: module
        for prefix, module in model.named_modules()
        for name, _ in module.named_parameters(recurse=False)
    }


def _finish(session: _Session, vllm_config) -> dict[str, float]:
    """Run post-load processing on what the send wrote; return the seconds of each part.

    The GPU work is only launched here; direct_load_finish waits for it.

    The first sync into a model runs vLLM's own post-load function over the whole model, as vLLM's
    loader does after a load. A later sync rewrote the same weights in the same places, so it runs
    only what must see them again: the quantization method of each written layer for which
    vllm_adapter.post_load_needed_again says so, then every module's own hook, as vLLM's function
    does, from the list vllm_adapter.post_load_hooks made after the first. For example, MLA attention
    derives W_UK_T and W_UV from kv_b_proj, and the MoE runner refills its fused gate. An FP8 expert
    layer was already quantized as its blocks were written: its one-shot guard keeps vLLM's method
    from quantizing it again, and its kernel is pointed at the new scales.
    """
    layout = session.layout
    set_current_vllm_config = internal("vllm.config", "set_current_vllm_config")
    fp8_layers = [m for m in session.touched.values() if fp8_scales(m, "w13_weight") is not None]
    rerun = [m for m in session.touched.values() if m not in fp8_layers]
    if layout.processed:
        rerun = [m for m in rerun if post_load_needed_again(m)]
    for module in rerun:  # These were rewritten, so clear the guard that would skip their processing.
        module.__dict__.pop("_already_called_process_weights_after_loading", None)
    seconds, start = {}, time.perf_counter()
    with torch.no_grad(), set_current_vllm_config(vllm_config):
        if not layout.processed:
            process = internal("vllm.model_executor.model_loader.utils", "process_weights_after_loading")
            process(layout.model, vllm_config.model_config, session.device)
            layout.post_load_hooks = post_load_hooks(layout.model, vllm_config.model_config, session.device)
            layout.processed = True
            seconds["post_load_whole_model"] = time.perf_counter() - start
        else:
            for module in rerun:
                module.quant_method.process_weights_after_loading(module)
            seconds["post_load_layers"] = time.perf_counter() - start
            for hook in layout.post_load_hooks:
                hook()
            seconds["post_load_hooks"] = time.perf_counter() - start - seconds["post_load_layers"]
        for module in fp8_layers:
            _fp8_experts().fp8_scales_to_kernel(module)
    seconds["post_load"] = time.perf_counter() - start
    session.layers_post_loaded = len(rerun)
    # Attention processing runs inside the post-load hooks; the key is kept for readers of the JSON.
    return {**seconds, "attention_post_load": 0.0}


@dataclass
class _Copies:
    """How a chunk's tensors are written, worked out before any is.

    Working it out is the Python per tensor, which costs more than the copies, so for the tensors in place,
    the same from one sync to the next, it is kept and made again while every parameter it writes is where it
    was (`unchanged`)."""

    blocks: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (expert parameter, bf16 block)
    fp8_blocks: list[tuple] = field(default_factory=list)  # fp8_experts.fp8_quantize_blocks' arguments, per block
    rows: list[torch.Tensor] = field(default_factory=list)  # the rows of layout.plain's tensors, copied from
    rows_from: list[torch.Tensor] = field(default_factory=list)  # these in one launch
    through_loader: list[tuple[str, torch.Tensor]] = field(default_factory=list)  # the model's load_weights
    first_seen: list[tuple[str, torch.Tensor]] = field(default_factory=list)  # learned first
    touched: dict[int, torch.nn.Module] = field(default_factory=dict)  # the layers written, for the finish
    # Each parameter written, once however many tensors it takes: (id(owner), name) -> (owner, name, _where()).
    written: dict[tuple[int, str], tuple[torch.nn.Module, str, tuple]] = field(default_factory=dict)

    def write(self, owner: torch.nn.Module, name: str) -> None:
        """Record that these copies write `owner`'s parameter `name`, where it is now."""
        self.written[id(owner), name] = (owner, name, _where(getattr(owner, name, None)))

    def unchanged(self) -> bool:
        """Return whether these copies can be made again as they are: each directly, into parameters still
        where they were."""
        return not (self.through_loader or self.first_seen) and all(
            _where(getattr(owner, name, None)) == where for owner, name, where in self.written.values()
        )


def _where(param: torch.Tensor | None) -> tuple:
    """Where a parameter is: the object, its storage, shape and strides."""
    return (id(param), param.data_ptr(), param.shape, param.stride()) if param is not None else ()


def _copies(session: _Session, tensors, trainer_rank: int | None) -> _Copies:
    """Work out how each tensor of a chunk is written; raise before any is, naming a block this engine cannot take.

    Each expert block from the trainer rank on this GPU is one copy into its layer's fused parameter, quantized
    on the way if vLLM serves it in FP8. Each tensor that vLLM's loader is known to write unchanged into a
    block of rows of one parameter, layout.plain, is one copy there. The rest go through the model's own
    `load_weights`, and a name not seen before is learned first.
    """
    layout, copies = session.layout, _Copies()
    for name, tensor in tensors:
        layer_name, _, tensor_name = name.rpartition(".")
        experts = layout.expert_layers.get(layer_name)
        if experts is not None and tensor_name in EXPERT_TENSORS:
            param_name = EXPERT_TENSORS[tensor_name]
            param, held = getattr(experts, param_name), layout.held_experts[layer_name]
            if problem := _block_problem(experts, name, param, tuple(tensor.shape), tensor.dtype, trainer_rank, held):
                raise ValueError(problem)
            if (scales := fp8_scales(experts, param_name)) is not None:
                shards = _fp8_experts().fp8_shards(experts, param_name)
                copies.fp8_blocks.append((tensor, shards, param.data, scales.data))
                copies.write(experts, f"{param_name}_scale_inv")
            else:
                copies.blocks.append((param.data, tensor))
            copies.write(experts, param_name)
            copies.touched[id(experts)] = experts
        elif name in layout.plain:
            rows = _plain_rows(layout, name, tensor)
            if rows is None:  # Its parameter changed shape or dtype, so learn it again.
                del layout.plain[name]
                copies.first_seen.append((name, tensor))
                continue
            copies.rows.append(rows)
            copies.rows_from.append(tensor)
            param_name = layout.plain[name][0]
            owner = layout.param_owner[param_name]
            copies.write(owner, param_name.rpartition(".")[2])
            copies.touched[id(owner)] = owner
        elif name in layout.through_loader:
            copies.through_loader.append((name, tensor))
        else:
            copies.first_seen.append((name, tensor))
    return copies


def _load(session: _Session, tensors, trainer_rank: int | None, vllm_config, copies: _Copies | None = None):
    """Write one chunk's tensors into the engine's model as _copies works out, or as `copies` says.

    The copies are launched first, all of layout.plain's rows at once; then each name not seen before is
    probed alone through vLLM's loader, to learn whether it writes the tensor unchanged, and the rest go
    through `load_weights` in one call. Record the written layers for direct_load_finish. Return the copies
    made, and the perf_counter times when the copies and the loads were launched.
    """
    set_current_vllm_config = internal("vllm.config", "set_current_vllm_config")
    layout = session.layout
    copies = copies or _copies(session, tensors, trainer_rank)
    with torch.no_grad():
        for param, block in copies.blocks:
            param.copy_(block)
        for args in copies.fp8_blocks:
            _fp8_experts().fp8_quantize_blocks(*args)
        if copies.rows:
            torch._foreach_copy_(copies.rows, copies.rows_from)  # One launch for many small tensors.
        session.touched.update(copies.touched)
        experts_done = time.perf_counter()
        if not (copies.first_seen or copies.through_loader):
            return copies, experts_done, experts_done
        others = list(copies.through_loader)
        with set_current_vllm_config(vllm_config):
            for name, tensor in copies.first_seen:  # Once per name: does vLLM's loader write it unchanged?
                if (learned := _learn(layout, name, tensor)) is not None:
                    layout.plain[name] = learned
                    _plain_rows(layout, name, tensor).copy_(tensor)
                    _touch(session, [learned[0]])
                else:  # It writes several parameters, another dtype, or moves or changes elements.
                    layout.through_loader.add(name)
                    others.append((name, tensor))
            if others:
                _touch(session, layout.model.load_weights(others) or ())
    return copies, experts_done, time.perf_counter()


@contextlib.contextmanager
def _put_back(layout: _Layout, restored: dict):
    """Keep a copy of every tensor vLLM's loader may write while the block runs, and put each back after it.

    That is every parameter and persistent buffer (vLLM's AutoWeightsLoader loads those too), but the fused
    expert weights, into which no probe is loaded. The copies are on the CPU, so a serving engine needs no GPU
    memory for them. A tensor the loader gave new storage gets its own back, where vLLM's kernels read it. What
    was derived from the weights after vLLM's load still matches them: `load_weights` derives nothing, and the
    probes run no post-load processing. `restored` is filled with the tensors, bytes and seconds it took.
    """
    start = time.perf_counter()
    fused = {
        id(t)
        for layer in layout.expert_layers.values()
        for name in EXPERT_TENSORS.values()
        for t in (getattr(layer, name, None), fp8_scales(layer, name))
        if t is not None
    }
    loadable = {}
    for module in layout.model.modules():
        buffers = [b for n, b in module.named_buffers(recurse=False) if n not in module._non_persistent_buffers_set]
        loadable.update((id(t), t) for t in [*module.parameters(recurse=False), *buffers] if id(t) not in fused)
    kept = [(t, t.data, t.detach().to("cpu", copy=True)) for t in loadable.values()]
    restored.update(tensors=len(kept), bytes=sum(c.numel() * c.element_size() for _, _, c in kept))
    copied = time.perf_counter() - start
    try:
        yield
    finally:
        start = time.perf_counter()
        for tensor, storage, copy in kept:
            storage.copy_(copy)  # `storage` is the tensor's own data, outside autograd
            if tensor.data_ptr() != storage.data_ptr() or tensor.shape != storage.shape:
                tensor.data = storage
        restored["seconds"] = copied + time.perf_counter() - start  # both copies, not the learning between


def _in_fused_experts(layout: _Layout, name: str) -> bool:
    """Return whether vLLM's loader may write `name` into a fused expert weight.

    That is an expert block, or a tensor of a module inside an expert layer, such as one expert's weight. A
    layer's other tensors of its own, such as gpt-oss's expert biases, have parameters of their own.
    """
    parts = name.split(".")
    inside = any(".".join(parts[:i]) in layout.expert_layers for i in range(1, len(parts) - 1))
    return inside or (name.rpartition(".")[0] in layout.expert_layers and parts[-1] in EXPERT_TENSORS)


def _learn(layout: _Layout, name: str, tensor: torch.Tensor) -> tuple[str, int] | None:
    """Return (parameter name, first row) if `load_weights` writes `tensor` unchanged into whole rows of one parameter.

    The rows may be the whole parameter or its slice of a stacked q/k/v or gate/up; nothing else
    may be written. Return None otherwise. Two random probes of the tensor's shape are loaded in
    its place. Random values are needed because a tensor of equal elements, such as a norm's
    initial ones, cannot reveal a loader that moves or changes elements. The first probe finds
    the parameter and the rows. The second must land in the same rows, bit for bit, and leave
    every other row of that parameter as the first left it.
    """
    first = _probe(tensor, name, 0)
    if first is None:
        return None
    loaded = sorted(layout.model.load_weights([(name, first)]) or ())
    param = _parameter(layout, loaded[0]) if len(loaded) == 1 else None
    row = _row_of(param, first) if param is not None else None
    if row is None:
        return None
    before, second = param.detach().clone(), _probe(tensor, name, 1)
    if sorted(layout.model.load_weights([(name, second)]) or ()) != loaded:
        return None
    rows = slice(row, row + tensor.shape[0])
    before[rows] = second
    return (loaded[0], row) if torch.equal(_bit_rows(param), _bit_rows(before)) else None


def _parameter(layout: _Layout, name: str) -> torch.nn.Parameter | None:
    """Look up the engine's parameter of this name in the layout, without walking the model."""
    owner = layout.param_owner.get(name)
    return getattr(owner, name.rpartition(".")[2], None) if owner is not None else None


def _plain_rows(layout: _Layout, name: str, tensor: torch.Tensor) -> torch.Tensor | None:
    """Return the parameter rows that the plain copy of `name` writes, or None if they no longer fit."""
    param_name, row = layout.plain[name]
    param = _parameter(layout, param_name)
    kept, where = layout.views.get(name), _where(param)
    if kept is not None and kept[0] == where and kept[1].shape == tensor.shape:
        return kept[1]
    rows = _rows(param, row, tensor)
    if rows is None:
        layout.views.pop(name, None)
    else:
        layout.views[name] = (where, rows)
    return rows


def _rows(param: torch.Tensor | None, row: int, tensor: torch.Tensor) -> torch.Tensor | None:
    """Return `param`'s rows from `row` that a plain copy of `tensor` writes, or None if they do not fit.

    They fit if the dtype and row shape match and there are enough rows.
    """
    if (
        param is None
        or tensor.dim() == 0
        or tensor.numel() == 0
        or param.dtype != tensor.dtype
        or param.dim() != tensor.dim()
        or param.shape[1:] != tensor.shape[1:]
        or row + tensor.shape[0] > param.shape[0]
    ):
        return None  # A scalar or an empty tensor has no rows to copy; it goes through load_weights.
    return param.data[row : row + tensor.shape[0]]


def _row_of(param: torch.Tensor, probe: torch.Tensor) -> int | None:
    """Return the first row of `param` from which its rows hold `probe`'s bits, or None."""
    if _rows(param, 0, probe) is None:
        return None
    n = probe.shape[0]
    held, sought = _bit_rows(param), _bit_rows(probe)
    for row in torch.nonzero((held == sought[0]).all(dim=1)).flatten().tolist():
        if row + n <= held.shape[0] and torch.equal(held[row : row + n], sought):
            return row
    return None


def _bit_rows(t: torch.Tensor) -> torch.Tensor:
    """Return `t`'s bits as one row of bytes per row of `t`, or per element of a vector."""
    return t.detach().contiguous().reshape(t.shape[0], -1).view(torch.uint8)


def _probe(tensor: torch.Tensor, name: str, which: int) -> torch.Tensor | None:
    """Return random values in `tensor`'s shape and dtype, different for each name and `which`.

    A private generator is used so that the engine's sampling RNG is left alone. Return None for
    integer tensors.
    """
    if not tensor.is_floating_point():
        return None
    seed = zlib.crc32(name.encode()) * 2 + which
    generator = torch.Generator(device=tensor.device).manual_seed(seed)
    return torch.randn(tensor.shape, generator=generator, device=tensor.device).to(tensor.dtype)


def _touch(session: _Session, param_names) -> None:
    """Record the layers holding these parameters as written, for direct_load_finish to process."""
    for param_name in param_names:
        owner = session.layout.param_owner.get(param_name)
        if owner is not None:
            session.touched[id(owner)] = owner


def _gpu_uuid(device: torch.device) -> str:
    """Return the GPU's UUID in the form the trainer ranks report theirs, or "" off CUDA."""
    return str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else ""


def _expert_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    RoutedExperts = internal("vllm.model_executor.layers.fused_moe.routed_experts", "RoutedExperts")
    return {m.layer_name: m for m in model.modules() if isinstance(m, RoutedExperts)}


def _no_trainer_rank(gpu_uuid: str, trainer_gpu_uuids: list[str]):
    raise ValueError(
        f"no trainer rank on this engine's GPU ({gpu_uuid or 'no GPU'}); the trainer ranks are on "
        f"{trainer_gpu_uuids}: every engine needs a trainer rank on its own GPU"
    )


def _block_problem(
    experts, name: str, param: torch.Tensor, shape, dtype, trainer_rank: int, held: list[int] | None = None
) -> str | None:
    """Say why the trainer rank's block `name` does not match what `param` holds, or return None.

    `held` is the global ids of this engine's experts. If it is not given, it is read from vLLM's
    expert map, which waits for the GPU.
    """
    held = local_expert_ids(experts) if held is None else held
    n = shape[0]
    sent = list(range(trainer_rank * n, (trainer_rank + 1) * n))
    if not held or not sent:
        return f"{name}: this engine holds experts {held} and the trainer rank on its GPU sends {n}"
    param_name = EXPERT_TENSORS.get(name.rpartition(".")[2], "")
    # An FP8 layer is padded and filled from a bf16 block; fp8_layout_problem checks its shape.
    quantized = fp8_scales(experts, param_name) is not None
    if quantized:
        fp8 = _fp8_experts()
        if problem := fp8.fp8_backend_problem(experts) or fp8.fp8_layout_problem(experts, param_name, shape):
            return f"{name}: {problem}"
    if (
        held != sent
        or (dtype != torch.bfloat16 if quantized else (tuple(param.shape) != tuple(shape) or param.dtype != dtype))
        or getattr(experts, "is_fused_checkpoint_transposed", False)
    ):
        return (
            f"{name}: this engine holds experts {held[0]}..{held[-1]} as {tuple(param.shape)} {param.dtype}, "
            f"but the trainer rank on its GPU sends experts {sent[0]}..{sent[-1]} as {tuple(shape)} {dtype}. "
            "The direct loader needs tensor parallel size 1, experts split evenly over the GPUs, and "
            f"trainer rank r on the GPU of DP rank r; otherwise {USE_VLLMS_LOADER}"
        )
    return None


def _unpickle(payload: str) -> dict:
    # Follow vLLM's IPC engine: unpickle only when the server was told to accept pickles.
    # rlhf_ipc_fsdp_ep.py's server listens on a Unix socket only its user can reach; see
    # helpers.start_server.
    if os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION") != "1":
        raise ValueError("refusing to unpickle the update without VLLM_ALLOW_INSECURE_SERIALIZATION=1")
    return pickle.loads(base64.b64decode(payload))


# ---------------------------------------------------------------------------
# Routed experts in FP8, for --rollout-dtype fp8; the work is in fp8_experts.py
# ---------------------------------------------------------------------------


def fp8_scales(experts: torch.nn.Module, param_name: str) -> torch.Tensor | None:
    """Return the block scales of a fused expert weight that vLLM serves in block-wise FP8, or None.

    `param_name` is `w13_weight` or `w2_weight`. vLLM's per-block online method sets
    weight_block_size on the layer, which is how FP8 is recognized.
    """
    if param_name not in EXPERT_TENSORS.values() or list(getattr(experts, "weight_block_size", None) or ()) != [
        128,
        128,
    ]:
        return None
    return getattr(experts, f"{param_name}_scale_inv", None)


def _fp8_experts():
    """Import fp8_experts.py, which quantizes an FP8 expert layer's blocks as they are written."""
    try:
        from weight_sync import fp8_experts
    except ImportError as e:
        raise ImportError(
            "this server serves its routed experts in FP8: copy weight_sync/fp8_experts.py beside "
            "direct_load.py, on the server's PYTHONPATH"
        ) from e
    return fp8_experts
