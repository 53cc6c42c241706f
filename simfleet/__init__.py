"""A simulated inference fleet over real HTTP, for tests, demo and benchmarks.

One aiohttp server plays the Dynamo frontend (``/v1/models``,
``/v1/rl/workers``, ``/v1/chat/completions``, ``/v1/completions``) and the
system server of every worker (under ``/workers/{id}``: a Dynamo system server
by default, or a vLLM or SGLang server, per worker, which also generates), with
faults that tests inject per worker (latency, hang, failed loads, the old
status-200 error quirk, adapters listed but unroutable) and a control API
under ``/sim`` for driving a fleet in another process. How each worker's engine
was started (``EngineSetup``: vLLM without its LoRA or dev-mode routes or with
data parallelism behind several API servers, SGLang with an admin key or data
parallelism) is set per worker, and so is its role behind the frontend
(aggregated, or a disaggregated prefill or decode worker).

Modules: ``identity`` (deterministic ids), ``state`` (worker state and waits),
``lora_source`` (load URI checks), ``generation`` (what a worker generates,
and for which names), ``http_utils`` (shared replies, auth and request records),
``worker_routes`` (with the ``vllm_routes`` and ``sglang_routes`` personalities),
``frontend_routes`` (with ``placement``: which workers run a request),
``control_routes`` (one route table each), ``fleet`` (server
lifecycle), ``serve`` (run until cancelled).
"""

from .fleet import SimFleet
from .identity import instance_id_for, lora_id_for
from .serve import serve_forever
from .state import ENGINES, ROLES, EngineSetup, RecordedRequest, SimWorker, WorkerFaults

__all__ = [
    "ENGINES",
    "ROLES",
    "EngineSetup",
    "RecordedRequest",
    "SimFleet",
    "SimWorker",
    "WorkerFaults",
    "instance_id_for",
    "lora_id_for",
    "serve_forever",
]
