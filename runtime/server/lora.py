"""LoRA adapters in the server (vLLM's interface): `--lora-modules`, the `model` field picking an
adapter, `/v1/models` listing adapters under their base model, and the admin routes
`POST /v1/load_lora_adapter` / `POST /v1/unload_lora_adapter`.

The server keeps the name -> LoRARequest table (names are what clients send; the engine knows
adapters by id). Loading goes through the engine thread (`AsyncEngine.call`), which reads the
adapter and checks it against the model: a bad adapter is the engine's ValueError, answered as a
400 naming the problem. At most --max-cpu-loras adapters are registered at once, so no client
(not even the admin) can grow the server's memory without bound by loading names.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass
from typing import Any

from .errors import APIError

# A name travels in the `model` field, in metrics labels and in /v1/models.
_NAME = re.compile(r"^[\x21-\x7e]{1,256}$")


@dataclass(frozen=True)
class LoRAModule:
    """One `--lora-modules` entry."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModule:
    """`name=path` or vLLM's JSON form `{"name": ..., "path": ..., "base_model_name": ...}`;
    ValueError naming what is wrong (argparse shows it as a usage error)."""
    text = text.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"--lora-modules: {text!r} is not valid JSON ({exc})") from None
        if not isinstance(obj, dict):
            raise ValueError("--lora-modules: the JSON form is an object with name and path")
        unknown = set(obj) - {"name", "path", "base_model_name"}
        if unknown:
            raise ValueError(f"--lora-modules: unknown key(s) {', '.join(sorted(unknown))} "
                             "(expected name, path, base_model_name)")
        name, path, base = obj.get("name"), obj.get("path"), obj.get("base_model_name")
        if base is not None and not isinstance(base, str):
            raise ValueError("--lora-modules: base_model_name must be a string")
    else:
        name, sep, path = text.partition("=")
        base = None
        if not sep:
            raise ValueError(f"--lora-modules: {text!r} is neither name=path nor a JSON object")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"--lora-modules: name {name!r} must be 1-256 visible ASCII characters")
    if not isinstance(path, str) or not path:
        raise ValueError(f"--lora-modules: {name!r} needs a path")
    return LoRAModule(name, path, base)


def lora_module_arg(text: str) -> LoRAModule:
    """argparse type for --lora-modules."""
    import argparse

    try:
        return parse_lora_module(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class LoRARegistry:
    """name -> LoRARequest of the adapters this server serves; used on the event loop only (the
    engine calls are awaited through the engine thread)."""

    def __init__(self, base_names: list[str], max_loaded: int, max_loras: int = 1):
        self.base_names = list(base_names)
        self.max_loaded = max_loaded
        self.max_loras = max_loras
        self.adapters: dict[str, Any] = {}  # name -> LoRARequest
        self.requests_total: dict[str, int] = {}  # name -> requests served (kvserve:lora_requests_total)
        self._ids = itertools.count(1)

    def names(self) -> list[str]:
        return sorted(self.adapters)

    def resolve(self, model: str | None) -> Any | None:
        """The LoRARequest `model` names, None for the base model (or no `model`); 404 otherwise."""
        if model is None or model in self.base_names:
            return None
        request = self.adapters.get(model)
        if request is None:
            raise self.not_found(model)
        return request

    def not_found(self, model: str) -> APIError:
        return not_found(model, self.base_names + self.names())

    def count(self, request: Any | None) -> None:
        if request is not None and request.lora_name in self.adapters:
            self.requests_total[request.lora_name] = self.requests_total.get(request.lora_name, 0) + 1

    def new_request(self, name: str, path: str, base_model_name: str | None = None) -> Any:
        """A LoRARequest for a name that may be registered (400 when it may not)."""
        from kvserve.runtime.lora import LoRARequest

        if not isinstance(name, str) or not _NAME.match(name):
            raise APIError(400, "lora_name: must be 1-256 visible ASCII characters", param="lora_name")
        if not isinstance(path, str) or not path:
            raise APIError(400, "lora_path: must be the adapter's directory on the server", param="lora_path")
        if name in self.base_names:
            raise APIError(400, f"lora_name: {name!r} is the base model's name", param="lora_name")
        if name in self.adapters:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        if len(self.adapters) >= self.max_loaded:
            raise APIError(400, f"{len(self.adapters)} adapters are loaded, the most this server holds "
                           f"(--max-cpu-loras {self.max_loaded}); unload one first", param="lora_name")
        try:
            return LoRARequest(name, next(self._ids), path, base_model_name)
        except ValueError as exc:
            raise APIError(400, str(exc)) from None

    def register(self, request: Any) -> None:
        self.adapters[request.lora_name] = request

    def unregister(self, name: str) -> None:
        self.adapters.pop(name, None)
        self.requests_total.pop(name, None)  # its series ends: label values stay bounded

    def model_card_fields(self, name: str) -> dict[str, Any]:
        request = self.adapters[name]
        return {"root": request.lora_path, "parent": self.base_names[0]}


def not_found(model: str, served: list[str]) -> APIError:
    return APIError(404, f"The model `{model}` does not exist. Served: {', '.join(served)}.", param="model")


def load_static(engine: Any, registry: LoRARegistry, modules: list[LoRAModule]) -> None:
    """--lora-modules at start, on the loading thread (before the engine thread runs): a bad one
    fails the start, as it does in vLLM (the operator loads through the admin route instead, so
    that a bad adapter there is a status condition)."""
    for module in modules:
        try:
            request = registry.new_request(module.name, module.path, module.base_model_name)
        except APIError as err:
            raise ValueError(f"--lora-modules {module.name}: {err.message}") from None
        try:
            engine.add_lora(request)  # a data-parallel engine registers it on each of its engines
        except ValueError as exc:
            raise ValueError(f"--lora-modules {module.name}: {exc}") from None
        registry.register(request)
