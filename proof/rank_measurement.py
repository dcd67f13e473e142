# SPDX-License-Identifier: Apache-2.0
"""The trainer, timed and inspected from outside its code, in each rank.

The script's trainer is FSDPTrainer as a user writes one. `measure` wraps,
in every rank, what a sync goes through: the sender's weight source (timed,
fingerprinted for the exact check: FingerprintedSource, the exact check's
trainer half) and its client (timed), the send itself (timed), and the
optimizer (which parameters a step left as they were). The driver reads the
results with `measured`. The functions after RankMeasurement run in a rank
through `__ray_call__`, on any trainer with a `model` and a `device`.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

import helpers
from proof import exact_check_engine
from weight_sync.direct_load import TrainerSource


def measure(trainers: list) -> None:
    """On every rank, once setup_weight_transfer has built its sender
    (`trainer.sender`): RankMeasurement. Again after each new setup."""
    helpers.ray_get_all([t.__ray_call__.remote(_start_measuring) for t in trainers])


def _start_measuring(trainer) -> None:
    trainer.measurement = RankMeasurement(trainer)


def measured(trainers: list, method: str, *args) -> list:
    """RankMeasurement.<method>(*args) on every rank of `trainers`."""
    return helpers.ray_get_all([t.__ray_call__.remote(_measurement_call, method, *args) for t in trainers])


def _measurement_call(trainer, method: str, *args):
    return getattr(trainer.measurement, method)(*args)


class RankMeasurement:
    """One rank's sends and steps, measured (measure): its WeightSender built
    again around a timed, fingerprinted source and a timed client, its sends
    timed (TimedSender), its optimizer's steps watched (StepWatch)."""

    def __init__(self, trainer) -> None:
        sender, self.device, self.model = trainer.sender, trainer.device, trainer.model
        if isinstance(sender, TimedSender):  # measured already, and no new setup since: around the trainer's own
            sender = sender.unmeasured
        self.send_seconds: dict[str, float] = {}
        self.sent_source = sender.source  # for the exact check: what this rank sends
        self.fingerprinted = FingerprintedSource(TimedSource(sender.source, self.send_seconds))
        measured = helpers.weight_sender(
            sender.rank,
            TimedClient(sender.client.client, self.send_seconds),
            self.fingerprinted,
            sender.packed,
            sender.packed_buffer_size_bytes,
        )
        trainer.sender = TimedSender(measured, self.send_seconds, self.device, unmeasured=sender)
        if getattr(trainer, "optimizer", None) is not None and not isinstance(trainer.optimizer, StepWatch):
            trainer.optimizer = StepWatch(trainer.optimizer, trainer.model, self.device)
        self.optimizer = getattr(trainer, "optimizer", None)

    def sent_metadata(self) -> list[list]:
        """[name, dtype, shape, is an expert block] of every tensor this rank
        sends, in send order (expert blocks: LocalExpertSource's own experts)."""
        blocks = getattr(self.sent_source, "expert_blocks", {})
        return [
            [m.name, str(m.dtype).removeprefix("torch."), list(m.shape), m.name in blocks]
            for m in self.sent_source.metadata
        ]

    def start_sent_fingerprints(self) -> None:
        """Start sent_fingerprints' kernels, to run beside what comes next."""
        self.fingerprinted.start()

    def sent_fingerprints(self) -> dict:
        """exact_check_engine.exact_fingerprint of every tensor this rank sent
        in its last send, in send order, on its GPU, from its own model where
        it can (FingerprintedSource.fingerprints; rank_fingerprints adds the shards up)."""
        return self.fingerprinted.fingerprints()

    def set_exact_casts(self, casts: dict[int, str], rows: dict[int, int] | None = None) -> None:
        """Which sent tensors vLLM holds in another dtype, and the row of its
        parameter each piece of a stacked one lands at (exact_check_prepare).
        Also fingerprints a few rows of each dtype and width it will send, so
        that Triton compiles most of its kernels now rather than in the first
        sync (seconds; it specializes on a few more of their arguments)."""
        self.fingerprinted.casts, self.fingerprinted.rows = casts, rows or {}
        kinds = {
            (casts.get(i, dtype), tuple(shape[-1:]) if len(shape) > 1 else ())
            for i, (_, dtype, shape, _) in enumerate(self.sent_metadata())
            if not casts.get(i, "").startswith(exact_check_engine.FP8_BLOCKS)
        }
        exact_check_engine.exact_fingerprints(
            torch.zeros(16, *width, dtype=getattr(torch, dtype), device=self.device) for dtype, width in kinds
        )

    def send_breakdown(self) -> dict[str, float]:
        """Where this rank's last send went: `source` (producing the tensors:
        host time, see TimedSource), `server_*` (waiting on the server, rank 0
        only) and `engine_*` (the direct loader's own split of DP engine 0's
        part of that), `total`; the rest is packing, the GPU's gathers and
        the trainer ranks' handshakes."""
        return dict(self.send_seconds)

    def sync_bytes(self) -> dict[str, int]:
        return sync_bytes(self.model, self.sent_source)

    def unchanged_by_last_step(self) -> list[str]:
        """The parameters the last optimizer step left exactly as they were."""
        return self.optimizer.unchanged if isinstance(self.optimizer, StepWatch) else []


def sync_bytes(model: torch.nn.Module, source) -> dict[str, int]:
    """The model's bf16 bytes, and what one sync puts in each GPU's engine (`source`: a rank's)."""
    return {
        "model": sum(p.numel() * torch.bfloat16.itemsize for p in model.parameters()),
        "per_gpu": sum(math.prod(m.shape) * m.dtype.itemsize for m in source.metadata),
    }


def device_copy_gb_per_s(trainer, size_bytes: int = 512 * 1024**2, repeats: int = 10) -> float:
    """In a rank: its device's copy rate, GB of one buffer copied into
    another per second (each byte read once and written once), the rate a
    sync that writes each weight once cannot beat (benchmark.with_floor)."""
    source = torch.empty(size_bytes, dtype=torch.uint8, device=trainer.device)
    target = torch.empty_like(source)
    target.copy_(source)  # (the first copy pays for the kernel's start)
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
    """A WeightSender whose send() adds its whole time to `seconds["total"]`,
    the device synchronised (what send_breakdown reads), after clearing the
    last send's numbers."""

    def __init__(self, sender, seconds: dict[str, float], device: torch.device, unmeasured=None) -> None:
        self._sender, self._seconds, self._device = sender, seconds, device
        self.unmeasured = unmeasured  # the trainer's own sender, which `sender` was built around (RankMeasurement)

    def send(self) -> None:
        self._seconds.clear()
        start = time.perf_counter()
        self._sender.send()
        _synchronize(self._device)
        self._seconds["total"] = time.perf_counter() - start

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._sender, name)


class StepWatch:
    """An optimizer whose step() also records which parameters it left
    exactly as they were on every rank's shard (`unchanged`): a step that
    cannot reach a parameter (no gradient, a frozen weight) would otherwise
    pass unseen. It compares shards with shards: the optimizer's own
    parameters, each rank's FSDP2 shard."""

    def __init__(self, optimizer, model: torch.nn.Module, device: torch.device) -> None:
        self._optimizer, self._device = optimizer, device
        if hasattr(model, "reshard"):  # after a forward, FSDP2 may hold the root's own parameters unsharded
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
            dist.all_reduce(changed, op=dist.ReduceOp.MAX)  # changed on any rank's shard
        self.unchanged = [n for n, c in zip(self._names, changed.tolist(), strict=True) if not c]
        return result

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._optimizer, name)


def parameter_fingerprints(params) -> list[list[int]]:
    """The exact fingerprint of each parameter's local shard (its elements'
    bits by position), so any change to any element shows. (A plain sum of
    the bits did not: an AdamW step can move a norm's few elements by amounts
    that cancel.)"""
    return exact_check_engine.exact_fingerprints(p.to_local() if hasattr(p, "to_local") else p for p in params)


class SourceWrapper(TrainerSource):
    """A weight source around another: the same tensors and metadata, and
    anything else the source offers (e.g. expert_blocks)."""

    def __init__(self, source: TrainerSource) -> None:
        self._source = source

    def param_metas(self):
        return self._source.metadata

    def tensors(self):
        return self._source.tensors()

    def __getattr__(self, name: str):
        if name.startswith("_"):  # not yet set (a copy being built): not the source's either
            raise AttributeError(name)
        return getattr(self._source, name)


class TimedSource(SourceWrapper):
    """A weight source that adds the seconds spent producing its tensors to
    seconds["source"]: host time (FSDP's gathers and the casts are launched
    here; the GPU runs them while the next ones are launched). Waiting for the
    device after every tensor would time the GPU's part too, but it would also
    stall the send 400+ times a sync, so the measurement would slow down what
    it measures. The send's total is timed with the device synchronised."""

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
    """A weight sync client that adds the seconds spent in each of its calls
    (the server's share of a send, as the sender sees it) to `seconds`."""

    def __init__(self, client, seconds: dict[str, float]) -> None:
        self._client = client
        self._seconds = seconds

    def __getattr__(self, name: str):
        if name.startswith("_"):  # not yet set (a copy being built): not the client's either
            raise AttributeError(name)
        call = getattr(self._client, name)
        if not callable(call):  # an attribute (e.g. the direct loader client's experts_in_place): as it is
            return call

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                result = call(*args, **kwargs)
            finally:
                key = f"server_{name}"
                self._seconds[key] = self._seconds.get(key, 0.0) + time.perf_counter() - start
                self._seconds[f"{key}_calls"] = self._seconds.get(f"{key}_calls", 0) + 1
            # The direct loader says where the first engine's time went: kept
            # apart (engine_*), as a part of the server's share above.
            for part, seconds in (result.get("seconds", {}) if isinstance(result, dict) else {}).items():
                self._seconds[f"engine_{part}"] = self._seconds.get(f"engine_{part}", 0.0) + seconds
            return result

        return timed


class FingerprintedSource(SourceWrapper):
    """The exact check's half on the trainer: the fingerprint (exact_check_engine's,
    on the tensor's device, cast first to the dtype vLLM holds it in where
    `casts` says so) of every tensor a send takes. A tensor that is one model
    tensor cast (the source's `origins`: most of them) is fingerprinted after
    the send from the model itself, each rank its own FSDP shard where the
    shards add up to it (`partial`), from the second send on every kernel from
    one CUDA graph (exact_check_engine.HeldFingerprints; eagerly where --train's fp32
    masters are cast first): nothing is added to the send, and what is
    proved reaches back to the trainer's own parameters. The rest (a
    conversion's output) is fingerprinted as the send takes it, the kernels
    queued before the send's own copy of the tensor. An expert's tensor cut
    from a fused expert tensor (vLLM's loader) is one of the former: its
    slice of the model's tensor, by the rank that holds that expert, so a
    conversion that cuts or names it wrong fails the check. Each tensor is
    fingerprinted at the row of its vLLM parameter it lands at (`rows`)."""

    def __init__(self, source: TrainerSource) -> None:
        super().__init__(source)
        self.casts: dict[int, str] = {}  # from exact_targets: index in send order -> dtype name
        self.rows: dict[int, int] = {}  # from piece_rows: index -> the row of its parameter it lands at
        self._sums: dict[int, torch.Tensor] = {}  # index -> sums taken in the send
        self._from_model: dict[int, tuple] | None = None  # index -> (module, attribute, a rank's own block)
        self._held = exact_check_engine.HeldFingerprints()
        self._started = None  # what waits for the fingerprints start() launched
        self._partial: list[int] = []
        # index -> sums taken apart from the graph: an FP8 expert block's weight and scales; zeros where
        # a rank adds nothing to an expert's tensor (another rank holds that expert)
        self._apart: dict[int, torch.Tensor] = {}

    def tensors(self):
        if self._from_model is None:  # once, before the first send: the layout stays
            origins = getattr(self._source, "origins", None) or [None] * len(self.metadata)
            self._from_model = {i: o for i, o in enumerate(origins) if o and _shard_of(getattr(*o[:2]), o[2])}
        self._sums, self._started = {}, None  # a send that starts again (a retry) starts the fingerprints again
        for index, (name, tensor) in enumerate(self._source.tensors()):
            if index not in self._from_model:
                self._sums[index] = exact_check_engine.held_fingerprint_sums(
                    tensor, self.casts.get(index), self.rows.get(index, 0)
                )
            yield name, tensor

    def start(self) -> None:
        """Start fingerprinting, from the model, the tensors the last send
        took from it: on a GPU on a CUDA stream of its own, beside whatever
        the rank does next (fingerprints() waits for it)."""
        tensors, offsets, casts, self._partial, self._apart = [], [], [], [], {}
        nothing = None  # the sums of no element, shared by every expert another rank holds
        for index, (module, attribute, block, *piece) in (self._from_model or {}).items():
            if (shard := _shard_of(getattr(module, attribute), block)) is None:
                raise RuntimeError(f"{self.metadata[index].name}: laid out otherwise than in the send")
            local, offset, is_partial = shard
            if piece:  # one expert's rows of a fused expert tensor: from the rank that holds that expert
                (_, first, rows), mine = piece[0], piece[0][0] - offset
                self._partial += [index] if is_partial else []
                if not 0 <= mine < local.shape[0]:  # another rank's expert: this rank adds nothing
                    nothing = nothing if nothing is not None else torch.zeros(3, dtype=torch.int64, device=local.device)
                    self._apart[index] = nothing
                    continue
                local, offset, is_partial = local[mine, first : first + rows], 0, False
            held = self.casts.get(index)
            if held and held.startswith(exact_check_engine.FP8_BLOCKS):  # a rank's own block, quantized as vLLM does
                self._apart[index] = exact_check_engine.held_fingerprint_sums(local, held)
                continue
            tensors.append(local)
            offsets.append(offset + self.rows.get(index, 0))
            casts.append(_casts(local.dtype, self.metadata[index].dtype, self.casts.get(index)))
            self._partial += [index] if is_partial else []
        self._started = self._held.start(tensors, offsets, casts)

    def fingerprints(self) -> dict:
        """{"sums": [plain, by_column, by_position] of each tensor the last
        send took, "partial": the indices where those are this rank's
        shard's, to be added up over the ranks (rank_fingerprints)}."""
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
    """{index: fingerprint sums on the device} -> {index: as lists}, one copy per shape (a tensor's
    [3], an FP8 block's [2, 3]) rather than a wait for the device per tensor."""
    out = {}
    for shape in {tuple(t.shape) for t in sums.values()}:
        same = [i for i, t in sums.items() if tuple(t.shape) == shape]
        out.update(zip(same, torch.stack([sums[i] for i in same]).cpu().tolist()))
    return out


def _casts(held: torch.dtype, sent: torch.dtype, vllm_holds: str | None) -> tuple[torch.dtype, ...]:
    """The casts from a model tensor (`held` by the trainer) to what vLLM
    holds of it: to the dtype it is `sent` in, then to the one vLLM keeps it
    in (`vllm_holds`, a dtype's name, if another); only those that change it,
    since a tensor cast first cannot be fingerprinted from a CUDA graph."""
    out, dtype = [], held
    for target in (sent, getattr(torch, vllm_holds) if vllm_holds else sent):
        if target != dtype:
            out.append(target)
            dtype = target
    return tuple(out)


def _shard_of(tensor: torch.Tensor, block: bool) -> tuple[torch.Tensor, int, bool] | None:
    """(this rank's part of a model tensor, the row of dim 0 it starts at in
    the whole, whether the ranks' parts make up the whole): all of it if it is
    not sharded or is a rank's own block; its FSDP2 shard if dim 0 is split
    over all ranks. None for another layout (then it is fingerprinted in the send)."""
    if not hasattr(tensor, "to_local"):
        return tensor.detach(), 0, False
    local, mesh, placements = tensor.to_local().detach(), tensor.device_mesh, tensor.placements
    if block or mesh.size() == 1 or all(p.is_replicate() for p in placements):
        return local, 0, False
    world = dist.get_world_size() if dist.is_initialized() else 1
    if mesh.ndim != 1 or not placements[0].is_shard(0) or mesh.size() != world:
        return None
    rows = tensor.shape[0]
    return local, min(mesh.get_local_rank() * -(-rows // mesh.size()), rows), True  # torch.chunk's split


def rank_fingerprints(reports: list[dict]) -> list[list[list[int]]]:
    """Each rank's fingerprints of what it sent, from every rank's
    FingerprintedSource.fingerprints(): where a rank fingerprinted its shard
    of a tensor every rank sends whole, the sum of all ranks' shards."""
    partial = set(reports[0]["partial"]) if reports else set()
    modulus = exact_check_engine.FINGERPRINT_MODULUS
    whole = {i: [sum(column) % modulus for column in zip(*(r["sums"][i] for r in reports))] for i in partial}
    return [[whole.get(i, sums) for i, sums in enumerate(r["sums"])] for r in reports]
