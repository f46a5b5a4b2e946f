"""vLLM's runtime LoRA routes, present only where VLLM_ALLOW_RUNTIME_LORA_UPDATING is set (as in vLLM):

    POST /v1/load_lora_adapter    {"lora_name": ..., "lora_path": ...}          200, or 400 naming the reason
    POST /v1/unload_lora_adapter  {"lora_name": ..., "lora_int_id": optional}   200, 404 unknown, 409 in use

A loaded adapter is served under its name (a request's `model`) and listed by /v1/models. The adapter's
files are read and checked on a worker thread, then registered on the engine thread between two steps: a
malformed one is refused before any request can name it, and a load does not stall the running requests.
Ids are never reused within a server: the prefix cache keys blocks by adapter id, and the engine refuses an
id it has removed.
"""

from __future__ import annotations

import asyncio
import itertools

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from kernel_lab.engine.lora import LoRAAdapterError, LoRAAdapterInUse, LoRARequest, load_peft_adapter

from .protocol import APIError, _Strict, bad_request, engine_error
from .serving import OpenAIServing

ENV_SWITCH = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updates_allowed(environ) -> bool:
    """vLLM's reading of the switch: "1" or "true", any case."""
    return environ.get(ENV_SWITCH, "0").strip().lower() in ("1", "true")


class LoadLoRAAdapterRequest(_Strict):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(_Strict):
    lora_name: str
    lora_int_id: int | None = None


class LoRAServing(OpenAIServing):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # after the --lora-modules ids (1..n), and never one twice
        self._ids = itertools.count(max((r.lora_int_id for r in self.lora_requests.values()), default=0) + 1)
        self._busy: set[str] = set()   # names with a load or unload under way

    async def _on_engine(self, fn):
        try:
            return await self.async_engine.call(fn)
        except (ValueError, TypeError) as exc:   # the adapter's fault (LoRAAdapterError is a ValueError)
            raise bad_request(str(exc), "lora_path") from exc
        except LoRAAdapterInUse as exc:
            raise APIError(409, str(exc), param="lora_name", code="lora_adapter_in_use") from exc
        except Exception as exc:
            raise engine_error(exc) from exc

    async def load(self, body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        self.check_ready()
        name, path = body.lora_name, body.lora_path
        if not name or not path:
            raise bad_request("both lora_name and lora_path must be non-empty", "lora_name" if not name else
                              "lora_path")
        if name in self.lora_requests or name == self.model_name or name in self._busy:
            raise bad_request(f"the LoRA adapter {name!r} has already been loaded"
                              if name != self.model_name else f"{name!r} is the served model's name", "lora_name")
        manager = getattr(self.engine, "lora", None)
        if manager is None:
            raise bad_request("this server was started without --enable-lora", "lora_name")
        request = LoRARequest(name, next(self._ids), path)
        self._busy.add(name)
        try:
            try:   # reading the files happens off the engine thread, so the running requests keep stepping
                parsed = await asyncio.get_running_loop().run_in_executor(
                    None, load_peft_adapter, request, manager.config, manager.max_lora_rank)
            except LoRAAdapterError as exc:
                raise bad_request(str(exc), "lora_path") from exc
            await self._on_engine(lambda engine: engine.lora.register(request, parsed))
        finally:
            self._busy.discard(name)
        self.lora_requests[name] = request
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        self.check_ready()
        name = body.lora_name
        request = self.lora_requests.get(name)
        if request is None or name in self._busy or body.lora_int_id not in (None, request.lora_int_id):
            raise APIError(404, f"the LoRA adapter {name!r}" + ("" if body.lora_int_id is None else
                           f" with lora_int_id {body.lora_int_id}") + " cannot be found", param="lora_name",
                           code="lora_adapter_not_found")
        # new requests for it are a 404 from here on; the ones the engine already holds are counted there
        del self.lora_requests[name]
        self._busy.add(name)
        try:
            await self._on_engine(lambda engine: engine.remove_lora(request.lora_int_id))
        except BaseException:
            self.lora_requests[name] = request
            raise
        finally:
            self._busy.discard(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def add_routes(app: FastAPI, serving: LoRAServing) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        return await serving.load(body)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        return await serving.unload(body)
