# SPDX-License-Identifier: Apache-2.0
"""Time and inspect the trainer in each rank from outside its code.

The script's trainer is FSDPTrainer, written as a user would write one. In every rank, `measure` wraps what a
sync goes through. The sender's weight source is timed and fingerprinted for the exact check by
FingerprintedSource, the trainer's half of that check. The sender's client and the send itself are timed. The
optimizer is watched for parameters a step left unchanged. The driver reads the results with `measured`. The
functions after RankMeasurement run in a rank through `__ray_call__`, on any trainer with a `model` and a
`device`.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

import helpers
from proof import exact_check_engine, exact_placement
from weight_sync import ray_trainers
from weight_sync.direct_load import TrainerSource


def measure(trainers: list) -> None:
    """Install a RankMeasurement on every rank; call it after each setup_weight_transfer builds `trainer.sender`."""
    ray_trainers.ray_get_all([t.__ray_call__.remote(_start_measuring) for t in trainers])


def _start_measuring(trainer) -> None:
    trainer.measurement = RankMeasurement(trainer)


def measured(trainers: list, method: str, *args) -> list:
    """Call RankMeasurement.<method>(*args) on every rank of `trainers` and return the results."""
    return ray_trainers.ray_get_all([t.__ray_call__.remote(_measurement_call, method, *args) for t in trainers])


def _measurement_call(trainer, method: str, *args):
    return getattr(trainer.measurement, method)(*args)


class RankMeasurement:
    """Measure one rank's sends and steps.

    The rank's WeightSender is rebuilt around a timed, fingerprinted source and a timed client. TimedSender
    times its sends, and StepWatch watches its optimizer's steps.
    """

    def __init__(self, trainer) -> None:
        sender, self.device, self.model = trainer.sender, trainer.device, trainer.model
        if isinstance(sender, TimedSender):  # Measured already with no new setup since: wrap the trainer's own.
            sender = sender.unmeasured
        self.send_seconds: dict[str, float] = {}
        self.sent_source = sender.source  # What this rank sends, for the exact check.
        self.fingerprinted = FingerprintedSource(TimedSource(sender.source, self.send_seconds))
        measured = helpers.weight_sender(
            sender.rank,
            TimedClient(sender.client.client, self.send_seconds),
            self.fingerprinted,
            sender.packed,
            sender.packed_buffer_size_bytes,
            sender.retries,
        )
        if measured.in_place is not None:
            measured.in_place = TimedHandshake(measured.in_place, self.send_seconds, self.device)
        trainer.sender = TimedSender(measured, self.send_seconds, self.device, unmeasured=sender)
        if getattr(trainer, "optimizer", None) is not None and not isinstance(trainer.optimizer, StepWatch):
            trainer.optimizer = StepWatch(trainer.optimizer, trainer.model, self.device)
        self.optimizer = getattr(trainer, "optimizer", None)

    def sent_metadata(self) -> list[list]:
        """Return [name, dtype, shape, is an expert block] of every tensor this rank sends, in send order.

        Expert blocks are LocalExpertSource's own experts.
        """
        blocks = getattr(self.sent_source, "expert_blocks", {})
        return [
            [m.name, str(m.dtype).removeprefix("torch."), list(m.shape), m.name in blocks]
            for m in self.sent_source.metadata
        ]

    def own_experts(self) -> list[int]:
        """Return the send-order indices of the one-expert tensors whose expert this rank's own model shard holds.

        This is the trainer's own layout of the experts, read from the weight source's `origins`, which the
        exact check holds each engine's expert map to.
        """
        out = []
        for index, origin in enumerate(getattr(self.sent_source, "origins", None) or []):
            if origin and len(origin) > 3 and (shard := _shard_of(getattr(*origin[:2]), origin[2])) is not None:
                local, offset, _ = shard
                out += [index] if 0 <= origin[3][0] - offset < local.shape[0] else []
        return out

    def start_sent_fingerprints(self) -> None:
        """Launch sent_fingerprints' kernels so they run beside what comes next."""
        self.fingerprinted.start()

    def sent_fingerprints(self) -> dict:
        """Return the exact fingerprint of every tensor this rank sent in its last send, in send order.

        They are computed on its GPU, from its own model where possible; see FingerprintedSource.fingerprints.
        rank_fingerprints adds up the shards.
        """
        return self.fingerprinted.fingerprints()

    def set_exact_casts(self, casts: dict[int, str], rows: dict[int, int] | None = None) -> None:
        """Set which sent tensors vLLM holds in another dtype, and where each piece of a stacked one lands.

        `rows` gives the row of its parameter each piece lands at; both come from exact_check_prepare. Also
        fingerprint a few rows of each dtype and width it will send, so that Triton compiles most of its
        kernels now, which takes seconds, rather than in the first sync. Triton specializes on a few more
        arguments, so some kernels still compile later.
        """
        self.fingerprinted.casts, self.fingerprinted.rows = casts, rows or {}
        kinds = {
            (casts.get(i, dtype), tuple(shape[-1:]) if len(shape) > 1 else ())
            for i, (_, dtype, shape, _) in enumerate(self.sent_metadata())
            if not casts.get(i, "").startswith(exact_placement.FP8_BLOCKS)
        }
        exact_check_engine.exact_fingerprints(
            torch.zeros(16, *width, dtype=getattr(torch, dtype), device=self.device) for dtype, width in kinds
        )

    def send_breakdown(self) -> dict[str, float]:
        """Return where this rank's last send spent its time, in seconds.

        `source` is host time producing the tensors; see TimedSource. `server_*` is time waiting on the
        server, on rank 0 only, and `engine_*` is the direct loader's own split of DP engine 0's part of it.
        `total` is the whole send; the rest is packing, the GPU's gathers and the trainer ranks' handshakes.
        `started_at` and `ended_at` are the send's start and end by the machine's clock, which
        rounds.ray_call_split turns into Ray's share of the driver's call.
        """
        return dict(self.send_seconds)

    def sync_bytes(self) -> dict[str, int]:
        return sync_bytes(self.model, self.sent_source)

    def unchanged_by_last_step(self) -> list[str]:
        """Return the parameters the last optimizer step left exactly as they were."""
        return self.optimizer.unchanged if isinstance(self.optimizer, StepWatch) else []


def sync_bytes(model: torch.nn.Module, source) -> dict[str, int]:
    """Return the model's bf16 bytes and the bytes one sync puts in each GPU's engine, from a rank's `source`."""
    return {
        "model": sum(p.numel() * torch.bfloat16.itemsize for p in model.parameters()),
        "per_gpu": sum(math.prod(m.shape) * m.dtype.itemsize for m in source.metadata),
    }


def device_copy_gb_per_s(trainer, size_bytes: int = 512 * 1024**2, repeats: int = 10) -> float:
    """Measure, in a rank, its device's copy rate in GB per second from one buffer into another.

    Each byte is read once and written once, so a sync that writes each weight once cannot beat this rate;
    benchmark.with_floor uses it.
    """
    source = torch.empty(size_bytes, dtype=torch.uint8, device=trainer.device)
    target = torch.empty_like(source)
    target.copy_(source)  # Warm up: the first copy pays for the kernel's start.
    _synchronize(trainer.device)
    start = time.perf_counter()
    for _ in range(repeats):
        target.copy_(source)
    _synchronize(trainer.device)
    return repeats * size_bytes / (time.perf_counter() - start) / 1e9


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TimedSender:
    """Wrap a WeightSender so that send() records its whole time in `seconds["total"]`.

    Each send clears the last send's numbers, and the time includes synchronizing the device, so it covers
    the GPU's work. send_breakdown reads the result.
    """

    def __init__(self, sender, seconds: dict[str, float], device: torch.device, unmeasured=None) -> None:
        self._sender, self._seconds, self._device = sender, seconds, device
        self.unmeasured = unmeasured  # The trainer's own sender, which RankMeasurement built `sender` around.

    def send(self, empty_cache: bool = False) -> int:
        self._seconds.clear()
        self._seconds["started_at"] = time.time()  # by the machine's clock; see rounds.ray_call_split
        start = time.perf_counter()
        retries = self._sender.send(empty_cache)
        _synchronize(self._device)
        self._seconds["total"] = time.perf_counter() - start
        self._seconds["ended_at"] = time.time()
        return retries

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._sender, name)


class TimedHandshake:
    """Wrap a sources.InPlace so that its gather() adds its seconds to seconds["in_place_handshake"].

    That is the rank's handshake before a send: waiting for its GPU, exporting the handles of tensors that
    moved, and gathering every rank's handles to rank 0. The wait for the GPU is also kept on its own, as
    seconds["in_place_gpu_wait"].
    """

    def __init__(self, in_place, seconds: dict[str, float], device: torch.device) -> None:
        self._in_place, self._seconds, self._device = in_place, seconds, device

    def gather(self) -> None:
        start = time.perf_counter()
        _synchronize(self._device)  # what gather() waits for first, timed on its own; its own wait is then short
        waited = time.perf_counter() - start
        self._in_place.gather()
        for key, seconds in (("in_place_handshake", time.perf_counter() - start), ("in_place_gpu_wait", waited)):
            self._seconds[key] = self._seconds.get(key, 0.0) + seconds

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._in_place, name)


class StepWatch:
    """Wrap an optimizer so that step() records in `unchanged` the parameters it left exactly as they were.

    A step that cannot reach a parameter, because it has no gradient or is frozen, would otherwise pass
    unseen. A parameter counts as changed if any rank's shard changed. It compares the optimizer's own
    parameters, each rank's FSDP2 shard, before and after.
    """

    def __init__(self, optimizer, model: torch.nn.Module, device: torch.device) -> None:
        self._optimizer, self._device = optimizer, device
        if hasattr(model, "reshard"):  # After a forward, FSDP2 may hold the root's own parameters unsharded.
            model.reshard()
        names = {id(p): n for n, p in model.named_parameters()}
        self._params = [p for group in optimizer.param_groups for p in group["params"]]
        self._names = [names.get(id(p), f"(optimizer parameter {i})") for i, p in enumerate(self._params)]
        self.unchanged: list[str] = []

    def step(self, *args, **kwargs):
        before = parameter_fingerprints(self._params)
        result = self._optimizer.step(*args, **kwargs)
        after = parameter_fingerprints(self._params)
        changed = torch.tensor(
            [a != b for a, b in zip(after, before, strict=True)], dtype=torch.int32, device=self._device
        )
        if dist.is_initialized():
            dist.all_reduce(changed, op=dist.ReduceOp.MAX)  # Changed on any rank's shard.
        self.unchanged = [n for n, c in zip(self._names, changed.tolist(), strict=True) if not c]
        return result

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._optimizer, name)


def parameter_fingerprints(params) -> list[list[int]]:
    """Return the exact fingerprint of each parameter's local shard, its elements' bits by position.

    Any change to any element shows. A plain sum of the bits would not do, because an AdamW step can move a
    norm's few elements by amounts that cancel.
    """
    return exact_check_engine.exact_fingerprints(p.to_local() if hasattr(p, "to_local") else p for p in params)


class SourceWrapper(TrainerSource):
    """Wrap a weight source, passing through its tensors, metadata and other attributes such as expert_blocks."""

    def __init__(self, source: TrainerSource) -> None:
        self._source = source

    def param_metas(self):
        return self._source.metadata

    def tensors(self):
        return self._source.tensors()

    def __getattr__(self, name: str):
        if name.startswith("_"):  # Not set yet, as while a copy is built; never forward these.
            raise AttributeError(name)
        return getattr(self._source, name)


class TimedSource(SourceWrapper):
    """Wrap a weight source to add the host seconds spent producing its tensors to seconds["source"].

    FSDP's gathers and the casts are launched here, and the GPU runs them while the next ones are launched.
    Waiting for the device after every tensor would time the GPU's part too, but it would stall the send
    400+ times a sync and slow down what it measures. The send's total is timed with the device synchronized.
    """

    def __init__(self, source: TrainerSource, seconds: dict[str, float]) -> None:
        super().__init__(source)
        self._seconds = seconds

    def tensors(self):
        items = self._source.tensors()
        while True:
            start = time.perf_counter()
            item = next(items, None)
            self._seconds["source"] = self._seconds.get("source", 0.0) + time.perf_counter() - start
            if item is None:
                return
            yield item


class TimedClient:
    """Wrap a weight sync client to add the seconds spent in each of its calls to `seconds`.

    That is the server's share of a send, as the sender sees it.
    """

    def __init__(self, client, seconds: dict[str, float]) -> None:
        self._client = client
        self._seconds = seconds

    def __getattr__(self, name: str):
        if name.startswith("_"):  # Not set yet, as while a copy is built; never forward these.
            raise AttributeError(name)
        call = getattr(self._client, name)
        if not callable(call):  # Plain attributes, such as the direct loader client's in_place.
            return call

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                result = call(*args, **kwargs)
            finally:
                key = f"server_{name}"
                self._seconds[key] = self._seconds.get(key, 0.0) + time.perf_counter() - start
                self._seconds[f"{key}_calls"] = self._seconds.get(f"{key}_calls", 0) + 1
            # The direct loader reports where the first engine's time went. Keep it as engine_*,
            # a part of the server's share above.
            for part, seconds in (result.get("seconds", {}) if isinstance(result, dict) else {}).items():
                self._seconds[f"engine_{part}"] = self._seconds.get(f"engine_{part}", 0.0) + seconds
            return result

        return timed


class FingerprintedSource(SourceWrapper):
    """Fingerprint every tensor a send takes; this is the trainer's half of the exact check.

    The fingerprint is exact_check_engine's, computed on the tensor's device after casting to the dtype vLLM
    holds it in, where `casts` says so. Each tensor is fingerprinted at the row of its vLLM parameter where it
    lands, from `rows`.

    Most tensors are one model tensor cast, as the source's `origins` says. These are fingerprinted after the
    send from the model itself, so nothing is added to the send and the proof reaches back to the trainer's
    own parameters. Each rank fingerprints its own FSDP shard where the shards add up to the tensor; those
    indices are `partial`. From the second send on, all these kernels run from one CUDA graph, see
    exact_check_engine.HeldFingerprints, except where --train's fp32 masters are cast first, which runs
    eagerly. An expert's tensor cut from a fused expert tensor for vLLM's loader is fingerprinted the same
    way, as its slice of the model's tensor by the rank that holds that expert, so a conversion that cuts or
    names it wrongly fails the check.

    The other tensors are a conversion's output. They are fingerprinted as the send takes them, with the
    kernels queued before the send's own copy of the tensor.
    """

    def __init__(self, source: TrainerSource) -> None:
        super().__init__(source)
        self.casts: dict[int, str] = {}  # From exact_targets: index in send order -> dtype name.
        self.rows: dict[int, int] = {}  # From piece_rows: index -> the row of its parameter it lands at.
        self._sums: dict[int, torch.Tensor] = {}  # Index -> sums taken during the send.
        self._from_model: dict[int, tuple] | None = None  # Index -> (module, attribute, is a rank's own block).
        self._held = exact_check_engine.HeldFingerprints()
        self._started = None  # Waits for the fingerprints start() launched.
        self._partial: list[int] = []
        # Index -> sums taken outside the graph: an FP8 expert block's weight and scales, or zeros where
        # this rank adds nothing to an expert's tensor because another rank holds that expert.
        self._apart: dict[int, torch.Tensor] = {}

    def _find_origins(self) -> dict[int, tuple]:
        """Find, once, the tensors fingerprinted from the model itself, because the layout stays the same."""
        if self._from_model is None:
            origins = getattr(self._source, "origins", None) or [None] * len(self.metadata)
            self._from_model = {i: o for i, o in enumerate(origins) if o and _shard_of(getattr(*o[:2]), o[2])}
        return self._from_model

    def tensors(self):
        self._find_origins()  # (a send with every tensor in place takes none of these, and never gets here)
        self._sums, self._started = {}, None  # A retried send starts the fingerprints again.
        for index, (name, tensor) in enumerate(self._source.tensors()):
            if index not in self._from_model:
                self._sums[index] = exact_check_engine.held_fingerprint_sums(
                    tensor, self.casts.get(index), self.rows.get(index, 0)
                )
            yield name, tensor

    def start(self) -> None:
        """Start fingerprinting, from the model, the tensors the last send took from it.

        On a GPU this runs on its own CUDA stream, beside whatever the rank does next; fingerprints() waits
        for it.
        """
        tensors, offsets, casts, self._partial, self._apart = [], [], [], [], {}
        nothing = None  # The sums of no elements, shared by every expert another rank holds.
        for index, (module, attribute, block, *piece) in self._find_origins().items():
            if (shard := _shard_of(getattr(module, attribute), block)) is None:
                raise RuntimeError(f"{self.metadata[index].name}: laid out otherwise than in the send")
            local, offset, is_partial = shard
            if piece:  # One expert's rows of a fused expert tensor, from the rank that holds that expert.
                (_, first, rows), mine = piece[0], piece[0][0] - offset
                self._partial += [index] if is_partial else []
                if not 0 <= mine < local.shape[0]:  # Another rank's expert; this rank adds nothing.
                    nothing = nothing if nothing is not None else torch.zeros(3, dtype=torch.int64, device=local.device)
                    self._apart[index] = nothing
                    continue
                local, offset, is_partial = local[mine, first : first + rows], 0, False
            held = self.casts.get(index)
            if held and held.startswith(exact_placement.FP8_BLOCKS):  # Own block, quantized as vLLM does.
                self._apart[index] = exact_check_engine.held_fingerprint_sums(local, held)
                continue
            tensors.append(local)
            offsets.append(offset + self.rows.get(index, 0))
            casts.append(_casts(local.dtype, self.metadata[index].dtype, self.casts.get(index)))
            self._partial += [index] if is_partial else []
        self._started = self._held.start(tensors, offsets, casts)

    def fingerprints(self) -> dict:
        """Return {"sums": ..., "partial": ...} for the tensors the last send took.

        "sums" holds [plain, by_column, by_position] for each tensor. "partial" lists the indices whose sums
        cover only this rank's shard; rank_fingerprints adds those up over the ranks.
        """
        if self._started is None:
            self.start()
        started, self._started = self._started, None
        graphed = [i for i in (self._from_model or {}) if i not in self._apart]
        from_model = dict(zip(graphed, started(), strict=True))
        from_model.update(_read_back(self._apart))
        taken = _read_back(self._sums)
        return {
            "sums": [from_model[i] if i in from_model else taken[i] for i in range(len(self.metadata))],
            "partial": self._partial,
        }


def _read_back(sums: dict[int, torch.Tensor]) -> dict[int, list]:
    """Copy {index: fingerprint sums on the device} to {index: lists}.

    Use one copy per shape, [3] for a tensor and [2, 3] for an FP8 block, rather than a device wait per tensor.
    """
    out = {}
    for shape in {tuple(t.shape) for t in sums.values()}:
        same = [i for i, t in sums.items() if tuple(t.shape) == shape]
        out.update(zip(same, torch.stack([sums[i] for i in same]).cpu().tolist()))
    return out


def _casts(held: torch.dtype, sent: torch.dtype, vllm_holds: str | None) -> tuple[torch.dtype, ...]:
    """Return the casts from a trainer tensor in dtype `held` to what vLLM holds of it.

    First to the dtype it is `sent` in, then to `vllm_holds`, the name of the dtype vLLM keeps it in, if
    given. Only casts that change the dtype are listed, because a tensor cast first cannot be fingerprinted
    from a CUDA graph.
    """
    out, dtype = [], held
    for target in (sent, getattr(torch, vllm_holds) if vllm_holds else sent):
        if target != dtype:
            out.append(target)
            dtype = target
    return tuple(out)


def _shard_of(tensor: torch.Tensor, block: bool) -> tuple[torch.Tensor, int, bool] | None:
    """Return (this rank's part of a model tensor, its first row in dim 0, whether the ranks' parts add up).

    The part is the whole tensor if it is not sharded or is a rank's own block, and its FSDP2 shard if dim 0
    is split over all ranks. Return None for any other layout; such a tensor is fingerprinted in the send.
    """
    if not hasattr(tensor, "to_local"):
        return tensor.detach(), 0, False
    local, mesh, placements = tensor.to_local().detach(), tensor.device_mesh, tensor.placements
    if block or mesh.size() == 1 or all(p.is_replicate() for p in placements):
        return local, 0, False
    world = dist.get_world_size() if dist.is_initialized() else 1
    if mesh.ndim != 1 or not placements[0].is_shard(0) or mesh.size() != world:
        return None
    rows = tensor.shape[0]
    return local, min(mesh.get_local_rank() * -(-rows // mesh.size()), rows), True  # As torch.chunk splits.


def rank_fingerprints(reports: list[dict]) -> list[list[list[int]]]:
    """Return each rank's fingerprints of what it sent, from every rank's FingerprintedSource.fingerprints().

    Where a rank fingerprinted only its shard of a tensor every rank sends whole, use the sum over all ranks.
    """
    partial = set(reports[0]["partial"]) if reports else set()
    modulus = exact_check_engine.FINGERPRINT_MODULUS
    whole = {i: [sum(column) % modulus for column in zip(*(r["sums"][i] for r in reports))] for i in partial}
    return [[whole.get(i, sums) for i, sums in enumerate(r["sums"])] for r in reports]
