# SPDX-License-Identifier: Apache-2.0
"""Provide the RL part of rlhf_ipc_fsdp_ep.py: a toy task and one REINFORCE step.

Replace these with your own reward, batch and loss; the weight sync does not depend on anything here. The
script mixes PolicyGradientStep into its trainer, `RLTrainer`, which supplies the model, the optimizer and
the forward pass, `FSDPTrainer._token_logprobs`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from weight_sync import generation


def add_arguments(parser) -> None:
    """Add the RL loop's flags to `parser`."""
    add = parser.add_argument
    add(
        "--train",
        action="store_true",
        help="each round: sample from vLLM, score with a toy reward, "
        "one AdamW policy-gradient step on fp32 master weights while vLLM sleeps, then sync",
    )
    add("--lr", type=float, default=1e-5, help="AdamW learning rate (--train)")
    add("--samples-per-prompt", type=int, default=4, help="completions per prompt per round (--train)")
    add("--temperature", type=float, default=1.0, help="sampling temperature (--train)")


class PolicyGradientStep:
    """Mix a training step into an FSDPTrainer rank."""

    def train_step(self, samples: list[dict]) -> float:
        """Take one REINFORCE step and return the loss.

        The loss is -mean_i(advantage_i * mean log p(completion_i)) over samples with keys "prompt_ids",
        "completion_ids" and "advantage". Every rank takes its share, and FSDP averages the gradients.
        """
        if self.optimizer is None:
            raise RuntimeError("build the model for training first: build_model(..., lr=...), then init_weights()")
        self.model.train()
        mine = samples[self.rank :: self.world_size]
        # Every rank must run the same number of forward passes, because each one all-gathers
        # every layer, so pad the short ranks with weight-0 samples.
        padding = -(-len(samples) // self.world_size) - len(mine)
        weights = [1.0] * len(mine) + [0.0] * padding
        loss = torch.zeros((), device=self.device)
        for weight, sample in zip(weights, mine + samples[:1] * padding, strict=True):
            lp = self._token_logprobs(sample["prompt_ids"] + sample["completion_ids"])
            completion_lp = lp[len(sample["prompt_ids"]) - 1 :].mean()
            # Scaled so that FSDP's mean over ranks is the mean over the batch.
            loss = loss - weight * sample["advantage"] * completion_lp * self.world_size / len(samples)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(total := loss.detach().clone())
        return total.item() / self.world_size


def reward(text: str) -> float:
    """Score the toy task, writing plain words: the share of characters that are a-z or a space.

    An empty completion scores 0. Replace this with your own reward.
    """
    return sum(("a" <= c <= "z") or c == " " for c in text) / len(text) if text else 0.0


def policy_gradient_samples(batch: list[generation.Completion]) -> tuple[list[dict], float]:
    """Return samples for PolicyGradientStep.train_step, and the batch's mean reward.

    Each advantage is reward - batch mean, which is REINFORCE with a mean baseline. Return no samples if every
    advantage is zero, because a step would change nothing.
    """
    rewards = [reward(c.text) for c in batch]
    mean = sum(rewards) / len(rewards)
    samples = [
        {"prompt_ids": c.prompt_token_ids, "completion_ids": c.token_ids, "advantage": r - mean}
        for c, r in zip(batch, rewards, strict=True)
        if c.token_ids
    ]
    return (samples if any(s["advantage"] for s in samples) else []), mean
