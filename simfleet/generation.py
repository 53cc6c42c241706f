"""What a simulated worker generates, and for which names it may.

Agents run a canary on their own engine: one token, greedy, a fixed prompt,
asked with an adapter's served name, to learn that the name reaches the
adapter. The sim runs no model. Every engine kind answers the same short text
naming the worker and the model, so that a test can tell who answered and
for which name, and it counts a prompt's tokens as its words.

Which names reach a worker's generation is decided here once for the three
engine kinds: its base model and the adapters it holds, except those made
unroutable (``WorkerFaults.unroutable``: listed and loaded, yet unknown to
generation, like the stale registration of Dynamo issue #11163). Each route
module answers a name that does not reach it with its own engine's error.

A vLLM engine with data parallelism generates on one DP rank: a name reaches
that rank's engine when the rank holds the adapter (a load may have missed it,
``WorkerFaults.load_misses_ranks``), and its answer names the rank.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from .state import SimWorker

__all__ = ["generates", "generates_on_rank", "prompt_tokens", "reply_text", "text_completion"]


def generates(worker: SimWorker, model: str) -> bool:
    """Whether a generation for ``model`` reaches ``worker``'s engine."""
    if model in worker.faults.unroutable:
        return False
    return model == worker.base_model or model in worker.adapters


def generates_on_rank(worker: SimWorker, model: str, rank: int) -> bool:
    """Whether a generation for ``model`` reaches the engine of DP rank ``rank``."""
    if model in worker.faults.unroutable:
        return False
    return model == worker.base_model or rank in worker.ranks_holding(model)


def reply_text(worker: SimWorker, model: str, rank: int | None = None) -> str:
    """The text every generation of ``worker`` for ``model`` answers; with
    data parallelism, it names the DP ``rank`` that generated."""
    who = f"worker {worker.worker_id}"
    if rank is not None and worker.setup.data_parallel_size > 1:
        who += f" rank {rank}"
    return f"simulated reply from {who} using model {model}"


def prompt_tokens(prompt: str) -> int:
    """The sim's token count of a prompt: its words."""
    return len(prompt.split())


def text_completion(
    worker: SimWorker, model: str, prompt: str, max_tokens: int, rank: int | None = None
) -> dict[str, Any]:
    """An OpenAI ``text_completion`` of one token, as vLLM and Dynamo's frontend
    answer it: cut at ``max_tokens`` when that is 1, else at its end; ``rank``:
    the DP rank that generated it."""
    prompt_count = prompt_tokens(prompt)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": reply_text(worker, model, rank),
                "logprobs": None,
                "finish_reason": "length" if max_tokens <= 1 else "stop",
            }
        ],
        "usage": {
            "prompt_tokens": prompt_count,
            "completion_tokens": 1,
            "total_tokens": prompt_count + 1,
        },
    }
