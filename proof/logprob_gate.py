# SPDX-License-Identifier: Apache-2.0
"""Gate a sync on vLLM's prompt log-probabilities matching the trainer's on the same tokens.

LogprobGap compares every DP engine with the trainer. The tolerances widen only to the trainer's own kernel
noise, KernelNoise, measured before the first sync by running the trainer's model through two attention
implementations, and with --rollout-dtype fp8 also with its experts as vLLM serves them, up to a ceiling past
which the gate cannot see a sync and leaves the verdict to the exact check. ChangeTest checks whether vLLM
followed a training step, and gates where the step is large enough to be seen over the noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from weight_sync import fp8_experts, generation, ray_trainers, sources


def _worst(values: list[float]) -> float:
    """Return the largest value, or NaN if any value is NaN; max() alone may skip a NaN."""
    return math.nan if any(math.isnan(v) for v in values) else max(values)


def prompt_logprobs(sock: str, model: str, token_ids: list[int], dp_rank: int | None = None) -> list[float]:
    """Return vLLM's log-probability of each prompt token after the first, given the ones before it.

    `dp_rank` pins the request to one DP engine.
    """
    out = generation.post_completions(
        sock, dp_rank, model=model, prompt=token_ids, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 0}
    )
    per_position = out.choices[0].prompt_logprobs
    # Position 0 has no context and is None. Each later entry maps token id -> info
    # and always holds the prompt's own token.
    return [entry[str(tok)]["logprob"] for tok, entry in zip(token_ids[1:], per_position[1:], strict=True)]


@dataclass
class LogprobGap:
    """Hold |trainer - vLLM| prompt log-probabilities on the same tokens, per DP engine.

    Every engine is asked, because each holds different experts.
    """

    mean_per_dp_rank: list[float]
    max_per_dp_rank: list[float]
    server: list[list[list[float]]]  # Per DP rank, per sequence, per token.
    trainer: list[list[float]] | None = None  # Per sequence, per token.
    quantile_per_dp_rank: list[float] | None = None  # The QUANTILE of |dlogp| per DP rank.

    @property
    def mean(self) -> float:  # The worst engine's.
        return _worst(self.mean_per_dp_rank)

    @property
    def max(self) -> float:
        return _worst(self.max_per_dp_rank)

    @property
    def quantile(self) -> float:
        return _worst(self.quantile_per_dp_rank or self.max_per_dp_rank)


# Quantile of |dlogp| over the tokens; the max grows with the token count, and bf16 kernels differ.
QUANTILE = 0.95


def dlogp_stats(reference: list[list[float]], other: list[list[float]]) -> tuple[float, float]:
    """Return (max, mean) of |a - b| over every token of every sequence.

    A NaN anywhere makes both NaN, which fails any `<= tolerance` gate.
    """
    diffs = _abs_diffs(reference, other)
    return _worst(diffs), sum(diffs) / len(diffs)


def dlogp_quantile(reference: list[list[float]], other: list[list[float]], q: float = QUANTILE) -> float:
    """Return the nearest-rank q-quantile of |a - b| over every token, or NaN if any is NaN."""
    diffs = _abs_diffs(reference, other)
    if any(math.isnan(d) for d in diffs):
        return math.nan
    return sorted(diffs)[min(len(diffs) - 1, math.ceil(q * len(diffs)) - 1)]


def _abs_diffs(reference: list[list[float]], other: list[list[float]]) -> list[float]:
    return [abs(d) for d in _diffs(other, reference)]


def _diffs(a: list[list[float]], b: list[list[float]]) -> list[float]:
    """Return a - b token by token over every sequence, flattened."""
    diffs: list[float] = []
    for x, y in zip(a, b, strict=True):
        if len(x) != len(y):
            raise ValueError(f"sequence lengths differ: {len(y)} vs {len(x)}")
        diffs += [u - v for u, v in zip(x, y, strict=True)]
    if not diffs:
        raise ValueError("no tokens to compare")
    return diffs


def logprob_gap(
    sock: str, model: str, trainer_lps: list[list[float]], sequences: list[list[int]], dp_size: int
) -> LogprobGap:
    """Ask every DP engine for its prompt log-probabilities of `sequences` and compare them with the trainer's."""
    server = [[prompt_logprobs(sock, model, seq, dp_rank=dp_rank) for seq in sequences] for dp_rank in range(dp_size)]
    stats = [dlogp_stats(trainer_lps, lps) for lps in server]
    quantiles = [dlogp_quantile(trainer_lps, lps) for lps in server]
    return LogprobGap([mean for _, mean in stats], [worst for worst, _ in stats], server, trainer_lps, quantiles)


def trainer_logprobs(trainers: list, sequences: list[list[int]]) -> list[list[float]]:
    """Return the trainer's log-probabilities of `sequences`; every rank runs the forward."""
    return ray_trainers.ray_get_all([t.token_logprobs.remote(sequences) for t in trainers])[0]


def job_logprob_gap(job, sequences: list[list[int]]) -> LogprobGap:
    """Run logprob_gap between a colocated job's trainers and every one of its DP engines."""
    return logprob_gap(
        job.server.socket_path, job.served_name, trainer_logprobs(job.trainers, sequences), sequences, job.dp_size
    )


@dataclass
class KernelNoise:
    """Hold how far two correct bf16 forwards of the trainer's own model drift apart.

    It is |dlogp| between its attention through SDPA and through the eager code, on the same weights and
    tokens. It is small on a shallow model. On a deep model with random weights, such as the Moonlight
    shape, it is as large as the gap between the trainer and vLLM, so that gap then says nothing against
    the sync.
    """

    mean: float
    quantile: float  # The QUANTILE of |dlogp|.
    attention: str  # Which two implementations, e.g. "sdpa vs eager".
    # With --rollout-dtype fp8: the same between the trainer's model and itself with its experts
    # quantized as vLLM holds them, from fp8_experts_logprobs. This is what FP8 alone moves.
    fp8_mean: float | None = None
    fp8_quantile: float | None = None

    @property
    def bound_mean(self) -> float:
        """Return the gap a correct sync may show: the kernels' noise, plus FP8's if vLLM serves FP8."""
        return self.mean + (self.fp8_mean or 0.0)

    @property
    def bound_quantile(self) -> float:
        return self.quantile + (self.fp8_quantile or 0.0)


def kernel_noise(trainers: list, sequences: list[list[int]], fp8: bool = False) -> KernelNoise | None:
    """Measure and print KernelNoise on `sequences`.

    This takes one extra forward through the other attention implementation, and with `fp8` one more with
    the experts as vLLM serves them in FP8. Return None if the model has only one attention implementation
    and `fp8` is off.
    """
    reference = trainer_logprobs(trainers, sequences)
    refs = [t.__ray_call__.remote(other_attention_logprobs, sequences) for t in trainers]
    other = ray_trainers.ray_get_all(refs)[0]
    if other is None:
        print("[noise] the trainer's model has one attention implementation: no kernel noise measured", flush=True)
        if not fp8:
            return None
        noise = KernelNoise(0.0, 0.0, "one implementation")
    else:
        attention, lps = other
        noise = KernelNoise(dlogp_stats(reference, lps)[1], dlogp_quantile(reference, lps), attention)
        print(
            f"[noise] the trainer's own model, {attention} attention, identical weights: |dlogp| mean "
            f"{noise.mean:.4f}, p{QUANTILE * 100:.0f} {noise.quantile:.4f}",
            flush=True,
        )
    if fp8:
        lps = ray_trainers.ray_get_all([t.__ray_call__.remote(fp8_experts_logprobs, sequences) for t in trainers])[0]
        noise.fp8_mean, noise.fp8_quantile = dlogp_stats(reference, lps)[1], dlogp_quantile(reference, lps)
        print(
            f"[noise] the trainer's own model, its experts in FP8 as vLLM serves them: |dlogp| mean "
            f"{noise.fp8_mean:.4f}, p{QUANTILE * 100:.0f} {noise.fp8_quantile:.4f} (added to the above: the "
            "gate's basis)",
            flush=True,
        )
    return noise


def other_attention_logprobs(trainer, sequences: list[list[int]]) -> tuple[str, list[list[float]]] | None:
    """Run token_logprobs in a rank through the other attention implementation, for KernelNoise.

    The other implementation is eager for SDPA or flash, and SDPA for eager; it gives a second correct bf16
    forward of the same weights. Return None if the model refuses to switch.
    """
    current = trainer.model.config._attn_implementation
    other = "sdpa" if current == "eager" else "eager"
    try:
        trainer.model.set_attn_implementation(other)
    except (ValueError, ImportError):
        return None
    try:
        return f"{current} vs {other}", trainer.token_logprobs(sequences)
    finally:
        trainer.model.set_attn_implementation(current)


def fp8_experts_logprobs(trainer, sequences: list[list[int]]) -> list[list[float]]:
    """Run token_logprobs in a rank with the routed experts computing as vLLM's block-FP8 MoE kernel does.

    This measures what FP8 alone does to the trainer's log-probabilities. Each fused expert tensor of this
    rank is quantized through vLLM's own function and back, in place, and fp8_experts_forward quantizes the
    experts' activations as that kernel does. Afterwards the weights are restored from a copy in host memory
    and the experts' own forward is restored.
    """
    params, saved = dict(trainer.model.named_parameters()), {}
    fused = sources.fused_expert_tensors(trainer.model)
    experts = {trainer.model.get_submodule(name.rpartition(".")[0]) for name in fused}
    try:
        with torch.no_grad():
            for name in fused:
                local = params[name].to_local() if hasattr(params[name], "to_local") else params[name]
                saved[name] = (local, local.detach().to("cpu", copy=True))
                local.copy_(fp8_dequantized(local.to(torch.bfloat16), 2 if name.endswith("gate_up_proj") else 1))
        for module in experts:
            module.forward = fp8_experts_forward(module)  # An instance attribute overrides the class's forward.
        return trainer.token_logprobs(sequences)
    finally:
        for module in experts:
            module.__dict__.pop("forward", None)
        if hasattr(trainer.model, "reshard"):  # A forward that failed part way may leave modules gathered.
            trainer.model.reshard()
        with torch.no_grad():
            for local, original in saved.values():
                local.copy_(original)


def fp8_experts_forward(experts: torch.nn.Module, activations=None):
    """Return a forward for a transformers fused experts module that quantizes activations as vLLM does.

    The module has gate_up_proj [experts, 2 x intermediate, hidden], down_proj [experts, hidden,
    intermediate] and act_fn. The forward passes its input and the intermediate through `activations`,
    fp8_activations by default, as vLLM's block-FP8 Triton MoE kernel reads them. Otherwise it does the same
    arithmetic as the module's own loop.
    """
    quantized = fp8_activations if activations is None else activations

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for expert in top_k_index.unique().tolist():
            if expert >= experts.num_experts:  # An expert-parallel model gives this index to experts held elsewhere.
                continue
            token, slot = torch.where(top_k_index == expert)
            gate, up = torch.nn.functional.linear(quantized(hidden_states[token]), experts.gate_up_proj[expert]).chunk(
                2, dim=-1
            )
            down = torch.nn.functional.linear(quantized(experts.act_fn(gate) * up), experts.down_proj[expert])
            out.index_add_(0, token, (down * top_k_weights[token, slot, None]).to(out.dtype))
        return out

    return forward


def fp8_activations(x: torch.Tensor) -> torch.Tensor:
    """Quantize `x` to FP8 and back as vLLM's block-FP8 MoE kernel reads an activation.

    Each row is split into groups of 128 columns, the last padded with zeros. Each group is quantized to e4m3
    with scale equal to its largest magnitude / 448, at least 1e-10 / 448, as per_token_group_quant_fp8 does.
    """
    columns = x.shape[-1]
    padded = -(-columns // fp8_experts.FP8_BLOCK) * fp8_experts.FP8_BLOCK
    groups = torch.nn.functional.pad(x.float(), (0, padded - columns)).unflatten(-1, (-1, fp8_experts.FP8_BLOCK))
    scale = groups.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / 448.0
    back = (groups / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale
    return back.flatten(-2)[..., :columns].to(x.dtype)


def fp8_dequantized(block: torch.Tensor, shards: int) -> torch.Tensor:
    """Return an expert block [experts, shards x rows, columns] as vLLM serves it in FP8, back in float32.

    That is fp8_experts.fp8_reference's weight times its block scales, without the padding.
    """
    weight, scales = fp8_experts.fp8_reference(block, shards)
    block_size = fp8_experts.FP8_BLOCK
    values = weight.float() * scales.repeat_interleave(block_size, 1).repeat_interleave(block_size, 2)
    rows, step = block.shape[1] // shards, weight.shape[1] // shards
    return torch.cat([values[:, k * step : k * step + rows, : block.shape[2]] for k in range(shards)], dim=1)


# The most the kernel noise may widen the tolerances to. Past it a gate would pass an engine whose typical
# token's probability is off by a factor of e^0.5 = 1.65, or its 95th percentile token's by e^2 = 7.4: it no
# longer tells a sync from a wrong one, and the round's verdict is the exact check's.
MEAN_CEILING = 0.5
QUANTILE_CEILING = 2.0


@dataclass
class Tolerances:
    mean: float  # The main gate, because wrong weights move every token.
    quantile: float = 1.0  # The QUANTILE of |dlogp|, a guard against a few tokens grossly off.
    max: float | None = None  # The single worst token, if asked for.
    noise_multiple: float = 2.0
    kernel_noise: KernelNoise | None = None  # Measured once, before the first sync.

    @classmethod
    def from_args(cls, args, kernel_noise: KernelNoise | None = None) -> Tolerances:
        return cls(
            args.logprob_mean_tolerance,
            args.logprob_quantile_tolerance,
            args.logprob_max_tolerance,
            args.noise_multiple,
            kernel_noise,
        )

    def given(self, noise: LogprobGap | None = None) -> tuple[float, float]:
        """Return the (mean, quantile) tolerances.

        Each is the absolute tolerance, or `noise_multiple` times the trainer's own kernel noise bound,
        FP8's included, if that is larger; it is never tightened. The basis is measured only where the weights
        are identical by construction, without vLLM: the trainer against itself. `noise`, a trainer-vs-vLLM
        gap such as a round's `before`, is not a basis. It is what the gate judges, and the exact check that
        would vouch for it may itself be wrong, so a large gap in one round must not widen the next round's
        tolerance. `noise` is accepted and ignored so that callers read the same.
        """
        del noise
        k = self.kernel_noise
        return (
            self._floor(self.mean, k and k.bound_mean, MEAN_CEILING),
            self._floor(self.quantile, k and k.bound_quantile, QUANTILE_CEILING),
        )

    def beyond_ceiling(self) -> bool:
        """Return whether the kernel noise asks for a wider tolerance than the ceiling: the gate cannot see a sync."""
        k = self.kernel_noise
        return k is not None and (
            self.noise_multiple * k.bound_mean > max(self.mean, MEAN_CEILING)
            or self.noise_multiple * k.bound_quantile > max(self.quantile, QUANTILE_CEILING)
        )

    def _floor(self, absolute: float, kernel: float | None, ceiling: float) -> float:
        """Return one of given()'s tolerances from its absolute value and the kernel noise, None if unmeasured.

        The noise widens it up to `ceiling` at most; an absolute tolerance above that is the user's to give.
        """
        return absolute if kernel is None else max(absolute, min(self.noise_multiple * kernel, ceiling))


# The change test gates once the trainer's step moves its log-probabilities this many times the noise. A
# synced engine's residual is at most its gap after the step plus its gap before, so at half the step's change
# it fails only if the gap after the step is over 4 times the noise; a stale engine's residual is the change.
CHANGE_VISIBLE = 10.0


@dataclass
class ChangeTest:
    """Hold whether vLLM's log-probabilities followed the trainer's step.

    Per token, the trainer's change, after - before, is compared with each engine's. The verdict reads mean
    absolute values, which one token whose experts flipped after the step cannot dominate.
    """

    trainer_change_rms: float
    noise_rms: float  # |trainer - vLLM| with identical weights.
    residual_rms: float  # vLLM's change minus the trainer's, the worst engine's.
    # "followed", "did not follow", or "too small to see" when the step is below CHANGE_VISIBLE times the noise.
    verdict: str
    trainer_change_mean: float | None = None
    noise_mean: float | None = None  # The worst engine's mean |trainer - vLLM| before, or the kernel noise's bound.
    residual_mean_per_dp_rank: list[float] | None = None
    gated: bool = False  # Whether the verdict gates the round: the step was large enough to be seen.

    @property
    def worst_dp_rank(self) -> int:
        residuals = self.residual_mean_per_dp_rank or [0.0]
        return residuals.index(max(residuals))


def change_test(before: LogprobGap, after: LogprobGap, floor: float = 0.0) -> ChangeTest | None:
    """Run the change test after a training step; return None without the trainer's numbers.

    In `before`, vLLM held the previous sync and the trainer had not stepped; in `after`, both should hold
    the stepped weights. `floor` is the least noise assumed, the trainer's own kernel noise. An engine whose
    change differs from the trainer's by more than half the step's change did not follow it.
    """
    if before.trainer is None or after.trainer is None:
        return None
    t_change = _diffs(after.trainer, before.trainer)
    gaps = [_diffs(engine, before.trainer) for engine in before.server]
    residuals = []
    for engine_before, engine_after in zip(before.server, after.server, strict=True):
        v_change = _diffs(engine_after, engine_before)
        residuals.append([v - t for v, t in zip(v_change, t_change, strict=True)])
    change, noise = _mean_abs(t_change), max(floor, *(_mean_abs(gap) for gap in gaps))
    per_engine = [_mean_abs(r) for r in residuals]
    gated = change > CHANGE_VISIBLE * noise
    if not gated:
        verdict = "too small to see"
    else:
        verdict = "followed" if max(per_engine) <= 0.5 * change else "did not follow"
    result = ChangeTest(_rms(t_change), max(map(_rms, gaps)), max(map(_rms, residuals)), verdict)
    result.trainer_change_mean, result.noise_mean, result.residual_mean_per_dp_rank = change, noise, per_engine
    result.gated = gated
    return result


def _mean_abs(values: list[float]) -> float:
    return sum(abs(v) for v in values) / len(values) if values else 0.0


def _rms(values: list[float]) -> float:
    return math.sqrt(sum(v * v for v in values) / len(values)) if values else 0.0


@dataclass
class Gate:
    passed: bool
    changed_per_dp_rank: list[bool]
    mean_tolerance: float | None = None  # As applied this round, given the trainer's kernel noise.
    quantile_tolerance: float | None = None
    change: ChangeTest | None = None
    # False when the kernel noise is beyond the ceiling and the exact check gives the verdict instead.
    tolerances_gated: bool = True


def gate(
    before: LogprobGap,
    after: LogprobGap,
    tolerances: Tolerances,
    weights_updated: bool,
    noise: LogprobGap | None = None,
    stepped: bool = False,
    exact_check_runs: bool = True,
) -> Gate:
    """Judge a round: it passes when every engine is within the tolerances after the sync.

    The tolerances come from Tolerances.given, based on the trainer's own kernel noise, never on a
    trainer-vs-vLLM gap. `noise`, the gap before the sync on weights the previous exact check proved, is
    only the change test's reference. If the weights were updated, every engine's log-probabilities must
    also have changed: a sync that silently did nothing on one engine leaves its numbers exactly as they
    were, because vLLM's outputs repeat bit for bit on the same weights, while the trainer's HF MoE forward
    need not. After a training step, `stepped`, the change test fails the round if an engine did not follow a
    step large enough to be seen. If the kernel noise asks for tolerances beyond the ceiling, the mean and the
    quantile are not gated where the exact check runs (`exact_check_runs`), which then gives the verdict; without
    it they are held to the ceiling. A NaN or an infinite gap fails every round.
    """
    changed = [b != a for b, a in zip(before.server, after.server, strict=True)]
    mean_tol, quantile_tol = tolerances.given(noise)
    floor = tolerances.kernel_noise.bound_mean if tolerances.kernel_noise else 0.0
    change = change_test(before, after, floor) if stepped and noise is not None else None
    gated = not (tolerances.beyond_ceiling() and exact_check_runs)
    passed = (
        math.isfinite(after.mean)
        and math.isfinite(after.quantile)
        and (not gated or (after.mean <= mean_tol and after.quantile <= quantile_tol))
        and (tolerances.max is None or after.max <= tolerances.max)
        and (all(changed) or not weights_updated)
        and (change is None or change.verdict != "did not follow")
    )
    return Gate(passed, changed, mean_tol, quantile_tol, change, gated)
