"""A real Dynamo 1.6.1 worker with the LoRA lifecycle, around the real mocker engine.

Run with the Dynamo virtualenv's python (``.real-dynamo/venv/bin/python``), never
imported by lorabus. The stock ``python -m dynamo.mocker`` has no LoRA and no RL
routes, so this does for the mocker what Dynamo's vLLM backend does for vLLM
(``dynamo/vllm/worker_factory.py`` and ``handlers.py``), on the real runtime:

- serves the request-plane endpoints ``load_lora``, ``unload_lora`` and
  ``list_loras`` of its component, which the runtime's system server dispatches
  ``POST/GET/DELETE /v1/loras`` to;
- resolves ``file://`` URIs with the runtime's ``LoRADownloader`` and publishes a
  model card per loaded adapter (``register_model(..., lora_name=...)``), removed
  again with ``unregister_model`` on unload, so the frontend lists and routes it;
- registers the RL admin routes (``/engine/pause_generation`` and friends)
  through ``dynamo.common.rl`` plus the ``rl`` endpoint, so the frontend's
  ``/v1/rl/workers`` finds it. No world size is given to the registry, like a
  backend that does not know it: discovery then carries none.

Where vLLM's engine would read the adapter (``add_lora``), this checks the PEFT
files and answers with vLLM's words when they are missing. Pause flips a flag
only. For tests, ``POST /engine/lorabus_test_state`` answers the pause flag and
the loads in progress, and ``LORA_WORKER_LOAD_DELAY_S`` makes every load of a
new adapter take that long (so a test can kill the worker mid-load).
These are internal Dynamo APIs: the install script pins the version.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
from pathlib import Path
from typing import Any

os.environ.setdefault("DYN_COMPUTE_THREADS", "0")

from dynamo.common.rl import (
    RLAdminValidationError,
    RLRouteRegistry,
    first_endpoint_response,
    register_rl_routes,
    require_lora_load_request,
    require_lora_unload_request,
)
from dynamo.common.utils.runtime import create_runtime
from dynamo.llm import (
    EngineType,
    EntrypointArgs,
    LoRADownloader,
    ModelInput,
    ModelType,
    WorkerType,
    lora_name_to_id,
    make_engine,
    register_model,
    run_input,
    unregister_model,
)
from dynamo.mocker.args import parse_args
from dynamo.mocker.config import (
    apply_worker_engine_args_overrides,
    build_runtime_config,
    load_mocker_engine_args,
)
from dynamo.mocker.utils.kv_cache import compute_kv_bytes_per_token
from dynamo.runtime.logging import configure_dynamo_logging

configure_dynamo_logging()
log = logging.getLogger("lora_worker")

LOAD_DELAY_ENV = "LORA_WORKER_LOAD_DELAY_S"


class LoraWorker:
    """The LoRA and RL handlers of one worker (the state a vLLM handler keeps)."""

    def __init__(
        self, model_path: str, generate_endpoint: Any, kv_block_size: int, mode: str = "agg"
    ) -> None:
        self.model_path = model_path
        self.mode = mode
        """``agg``, ``prefill`` or ``decode`` (the mocker's ``--disaggregation-mode``):
        how an adapter's model card is registered, as Dynamo's vLLM handler does."""
        self.generate_endpoint = generate_endpoint
        self.kv_block_size = kv_block_size
        self.load_delay_s = float(os.environ.get(LOAD_DELAY_ENV) or 0)
        self.downloader = LoRADownloader()
        self.loras: dict[str, int] = {}
        self.loading: set[str] = set()
        self.paused = False
        self.lock = asyncio.Lock()

    async def load_lora(self, request: Any = None) -> Any:
        try:
            name, uri = require_lora_load_request(request)
        except RLAdminValidationError as exc:
            yield {"status": "error", "message": str(exc)}
            return
        async with self.lock:
            if name in self.loras:
                yield _lora_reply(name, self.loras[name], "already loaded", hot_swap=False)
                return
            self.loading.add(name)
            try:
                yield await self._load(name, uri)
            finally:
                self.loading.discard(name)

    async def _load(self, name: str, uri: str) -> dict[str, Any]:
        try:
            path = await self.downloader.download_if_needed(uri)
        except Exception as exc:
            return {"status": "error", "message": f"Failed to download LoRA: {exc}"}
        if self.load_delay_s:
            await asyncio.sleep(self.load_delay_s)
        problem = _adapter_problem(name, Path(path))
        if problem:
            return {"status": "error", "message": problem, "lora_name": name}
        lora_id = lora_name_to_id(name)
        model_type, worker_type, needs = _card_of(self.mode)
        await register_model(
            ModelInput.Tokens,
            model_type,
            self.generate_endpoint,
            self.model_path,
            worker_type=worker_type,
            needs=needs,
            kv_cache_block_size=self.kv_block_size,
            user_data={"lora_adapter": True, "lora_id": lora_id},
            lora_name=name,
            base_model_path=self.model_path,
            ignore_weights=True,
        )
        self.loras[name] = lora_id
        log.info("loaded LoRA %s (id %d) from %s", name, lora_id, path)
        return _lora_reply(name, lora_id, "loaded successfully", hot_swap=False)

    async def unload_lora(self, request: Any = None) -> Any:
        try:
            name = require_lora_unload_request(request)
        except RLAdminValidationError as exc:
            yield {"status": "error", "message": str(exc)}
            return
        async with self.lock:
            if name not in self.loras:
                available = list(self.loras)
                message = f"LoRA adapter '{name}' not found. Available LoRAs: {available}"
                yield {"status": "error", "message": message}
                return
            await unregister_model(self.generate_endpoint, lora_name=name)
            lora_id = self.loras.pop(name)
            log.info("unloaded LoRA %s", name)
            yield _lora_reply(name, lora_id, "unloaded successfully")

    async def list_loras(self, request: Any = None) -> Any:
        yield {"status": "success", "loras": dict(self.loras), "count": len(self.loras)}

    async def pause_generation(self, body: Any) -> dict[str, Any]:
        body = body if isinstance(body, dict) else {}
        mode, clear_cache = body.get("mode", "keep"), bool(body.get("clear_cache", False))
        if mode not in ("keep", "wait", "abort"):
            return {
                "status": "error",
                "message": f"Invalid mode '{mode}'; expected keep|wait|abort",
            }
        self.paused = True
        return {
            "status": "ok",
            "message": "Engine paused",
            "mode": mode,
            "clear_cache": clear_cache,
        }

    async def resume_generation(self, body: Any) -> dict[str, Any]:
        self.paused = False
        return {"status": "ok", "message": "Engine resumed"}

    async def liveness_probe(self, body: Any) -> dict[str, Any]:
        return {"status": "ok", "alive": True}

    async def test_state(self, body: Any) -> dict[str, Any]:
        return {
            "status": "ok",
            "paused": self.paused,
            "loading": sorted(self.loading),
            "loras": dict(self.loras),
        }


def _card_of(mode: str) -> tuple[Any, Any, list[list[Any]]]:
    """An adapter card's model type, worker type and needs in a disaggregation
    mode, as Dynamo's vLLM handler registers them (dynamo/vllm/handlers.py)."""
    if mode == "prefill":
        return ModelType.Prefill, WorkerType.Prefill, [[WorkerType.Decode]]
    if mode == "decode":
        return ModelType.Chat | ModelType.Completions, WorkerType.Decode, [[WorkerType.Prefill]]
    return ModelType.Chat | ModelType.Completions, WorkerType.Aggregated, []


def _lora_reply(name: str, lora_id: int, what: str, **extra: Any) -> dict[str, Any]:
    message = f"LoRA adapter '{name}' {what}"
    return {"status": "success", "message": message, "lora_name": name, "lora_id": lora_id, **extra}


def _adapter_problem(name: str, path: Path) -> str | None:
    """vLLM's answer when ``add_lora`` cannot read a PEFT adapter at ``path``."""
    try:
        config = json.loads((path / "adapter_config.json").read_text())
    except (OSError, ValueError):
        config = None
    if not isinstance(config, dict) or not (path / "adapter_model.safetensors").is_file():
        return (
            f"Failed to add LoRA '{name}': Loading lora {name} failed: No adapter found for {path}"
        )
    return None


async def serve(model_path: str, model_name: str, mode: str) -> None:
    args = parse_args(
        ["--model-path", model_path, "--model-name", model_name, "--disaggregation-mode", mode]
    )
    args.speedup_ratio = 0.0
    if args.kv_bytes_per_token is None:
        args.kv_bytes_per_token = compute_kv_bytes_per_token(model_path, args.kv_cache_dtype)
    engine_args = apply_worker_engine_args_overrides(
        load_mocker_engine_args(args), kv_bytes_per_token=args.kv_bytes_per_token
    )
    runtime, loop = create_runtime(
        args.discovery_backend,
        args.request_plane,
        args.event_plane,
        response_plane=args.response_plane,
    )
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, runtime.shutdown)
    kv_block_size, runtime_config = build_runtime_config(engine_args)
    entrypoint = EntrypointArgs(
        engine_type=EngineType.Mocker,
        model_path=model_path,
        model_name=model_name,
        endpoint_id=args.endpoint,
        mocker_engine_args=engine_args,
        runtime_config=runtime_config,
        kv_cache_block_size=kv_block_size,
    )
    engine_config = await make_engine(runtime, entrypoint)
    path = args.endpoint.removeprefix("dyn://")
    namespace, component, _ = path.split(".")
    worker = LoraWorker(model_path, runtime.endpoint(path), kv_block_size, mode)

    def endpoint(name: str) -> Any:
        return runtime.endpoint(f"{namespace}.{component}.{name}")

    registry = RLRouteRegistry(runtime, logger_=log)

    async def load_route(body: dict[str, Any]) -> dict[str, Any]:
        return await first_endpoint_response(worker.load_lora, body)

    async def unload_route(body: dict[str, Any]) -> dict[str, Any]:
        return await first_endpoint_response(worker.unload_lora, body)

    rl_routes = {
        "liveness_probe": worker.liveness_probe,
        "pause_generation": worker.pause_generation,
        "resume_generation": worker.resume_generation,
        "load_lora": load_route,
        "unload_lora": unload_route,
    }
    register_rl_routes(runtime, registry, rl_routes, enable_dispatch=True)
    runtime.register_engine_route("lorabus_test_state", worker.test_state)

    serving = [
        asyncio.ensure_future(run_input(runtime, args.endpoint, engine_config)),
        asyncio.ensure_future(endpoint("load_lora").serve_endpoint(worker.load_lora)),
        asyncio.ensure_future(endpoint("unload_lora").serve_endpoint(worker.unload_lora)),
        asyncio.ensure_future(endpoint("list_loras").serve_endpoint(worker.list_loras)),
        asyncio.ensure_future(endpoint("rl").serve_endpoint(registry.dispatch_stream)),
    ]
    system_url = runtime.system_status_server_url()
    if os.environ.get("DYN_SYSTEM_PORT") and not system_url:
        # The runtime only logs a port it could not bind and serves on without
        # a system server; a test would then wait for nothing.
        runtime.shutdown()
        raise SystemExit(f"the system server did not start on port {os.environ['DYN_SYSTEM_PORT']}")
    runtime.set_health_status(True)
    log.info("LoRA test worker ready: %s, system url %s", path, system_url)
    try:
        await asyncio.gather(*serving, return_exceptions=True)
    finally:
        runtime.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--model-name", required=True)
    parser.add_argument(
        "--disaggregation-mode", choices=["agg", "prefill", "decode"], default="agg"
    )
    opts = parser.parse_args()
    import uvloop

    uvloop.run(serve(opts.model_path, opts.model_name, opts.disaggregation_mode))


if __name__ == "__main__":
    main()
