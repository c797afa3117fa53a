"""LoRA adapters as served models: the name -> LoRARequest registry a request's `model` selects from, the
adapters' cards in /v1/models, and vLLM's runtime routes POST /v1/load_lora_adapter and
/v1/unload_lora_adapter (mounted only with `allow_runtime_lora_updating`).

Reading and checking an adapter happens in the engine (a bad folder is a ValueError there, a 400 here); this
module owns only names and ids.
"""
from __future__ import annotations

import itertools

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from minivllm.engine.async_engine import AsyncEngine
from minivllm.lora.request import LoRARequest
from minivllm.server import errors
from minivllm.server.protocol import ModelCard


def parse_lora_modules(specs: list[str] | None) -> list[tuple[str, str]]:
    """`--lora-modules name=path ...` -> [(name, path)]; ValueError on a malformed entry."""
    modules = []
    for spec in specs or []:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes name=path entries, got {spec!r}")
        modules.append((name, path))
    return modules


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


class LoRAModules:
    """The adapters this server serves, by name (each request's `model` may be one of them)."""

    def __init__(self, engine: AsyncEngine, base_model_name: str, modules: list[tuple[str, str]] = ()) -> None:
        self.engine, self.base_model_name = engine, base_model_name
        self._ids = itertools.count(1)
        self.startup = [LoRARequest(name, next(self._ids), path, base_model_name) for name, path in modules]
        self.by_name: dict[str, LoRARequest] = {}

    async def load_startup_modules(self) -> None:
        """The `--lora-modules` adapters, read and checked before the server answers (a bad one stops it)."""
        for request in self.startup:
            await self.engine.call("add_lora", request)
            self.by_name[request.lora_name] = request

    def cards(self, max_model_len: int) -> list[ModelCard]:
        return [ModelCard(id=name, root=request.lora_path, parent=self.base_model_name, max_model_len=max_model_len)
                for name, request in self.by_name.items()]

    async def load(self, body: LoadLoRAAdapterRequest) -> str:
        if body.lora_name in self.by_name:
            raise errors.bad_request(f"the adapter {body.lora_name!r} is loaded already", param="lora_name")
        request = LoRARequest(body.lora_name, next(self._ids), body.lora_path, self.base_model_name)
        try:
            await self.engine.call("add_lora", request)
        except ValueError as e:
            raise errors.bad_request(str(e), param="lora_path") from None
        self.by_name[request.lora_name] = request
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    async def unload(self, body: UnloadLoRAAdapterRequest) -> str:
        request = self.by_name.get(body.lora_name)
        if request is None or body.lora_int_id not in (None, request.lora_int_id):
            raise errors.model_not_found(body.lora_name)
        del self.by_name[body.lora_name]   # new requests can no longer name it
        await self.engine.call("remove_lora", request.lora_int_id)
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."


def lora_router(modules: LoRAModules) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        return PlainTextResponse(await modules.load(body))

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        return PlainTextResponse(await modules.unload(body))

    return router
