# SPDX-License-Identifier: Apache-2.0
"""Generate through the vLLM server's OpenAI API over its socket: the rollouts of the example, batched, with token ids.

    batch = completions(sock, served_name, prompts, max_tokens=16, temperature=1.0)   # one Completion per prompt
    out = post_completions(sock, dp_rank=0, model=..., prompt=[ids], max_tokens=1, extra_body={"prompt_logprobs": 0})

`dp_rank` pins one DP engine (vLLM's X-data-parallel-rank header), as the proof scores each engine apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from helpers import SERVER_CALL_TIMEOUT_S, ServerError, forget_client, openai_client


@dataclass
class Completion:
    text: str
    prompt_token_ids: list[int]
    token_ids: list[int]


def post_completions(sock: str, dp_rank: int | None = None, **fields):
    """POST /v1/completions, raising ServerError; `dp_rank` pins one DP engine, `extra_body` takes vLLM's fields."""
    import openai

    headers = {"X-data-parallel-rank": str(dp_rank)} if dp_rank is not None else None
    try:
        return openai_client(sock).completions.create(extra_headers=headers, timeout=SERVER_CALL_TIMEOUT_S, **fields)
    except openai.APIStatusError as e:
        forget_client(sock)  # as request() does after an error reply
        raise ServerError(f"POST /v1/completions -> HTTP {e.status_code}: {e.response.text[:2000]}") from e
    except openai.APIError as e:
        forget_client(sock)
        raise ServerError(f"POST /v1/completions failed: {e!r}") from e


def completions(
    sock: str, model: str, prompts: list[str], max_tokens: int, temperature: float = 0.0, dp_rank: int | None = None
) -> list[Completion]:
    """Return one completion per prompt, greedy by default, with the prompt's and the output's token ids."""
    out = post_completions(
        sock,
        dp_rank,
        model=model,
        prompt=prompts,
        max_tokens=max_tokens,
        temperature=temperature,
        extra_body={"return_token_ids": True},
    )
    by_index = {c.index: c for c in out.choices}
    return [
        Completion(c.text, list(c.prompt_token_ids), list(c.token_ids))
        for c in (by_index[i] for i in range(len(prompts)))
    ]
