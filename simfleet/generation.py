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
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from .state import SimWorker

__all__ = ["generates", "prompt_tokens", "reply_text", "text_completion"]


def generates(worker: SimWorker, model: str) -> bool:
    """Whether a generation for ``model`` reaches ``worker``'s engine."""
    if model in worker.faults.unroutable:
        return False
    return model == worker.base_model or model in worker.adapters


def reply_text(worker: SimWorker, model: str) -> str:
    """The text every generation of ``worker`` for ``model`` answers."""
    return f"simulated reply from worker {worker.worker_id} using model {model}"


def prompt_tokens(prompt: str) -> int:
    """The sim's token count of a prompt: its words."""
    return len(prompt.split())


def text_completion(worker: SimWorker, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """An OpenAI ``text_completion`` of one token, as vLLM and Dynamo's frontend
    answer it: cut at ``max_tokens`` when that is 1, else at its end."""
    prompt_count = prompt_tokens(prompt)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": reply_text(worker, model),
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
