"""The engine's adapters (rank 0): the registry of known adapters, the device slot table, and
each step's `LoRAStepInput`.

Adapters are known by their integer id; a registered adapter may leave the host cache
(max_cpu_loras) and is read again from its directory when a request needs it. Each registration's
prefix-cache key is its name and a digest of its files (runtime/lora/identity.py): KV blocks
computed under one adapter are never reused under another (nor under new weights loaded under an
old name or id), and every pod that loads the same adapter keys its blocks alike.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvserve.runtime.lora.identity import adapter_digest, adapter_id, cache_key
from kvserve.runtime.lora.request import LoRARequest
from kvserve.runtime.lora.slots import LoRAStepInput, SlotTable, step_layout


class LoRAManager:
    def __init__(self, worker_lora, *, max_loras: int) -> None:
        self.worker = worker_lora  # rank 0's WorkerLoRA: loads and checks adapters
        self.max_loras = max_loras
        self.slots = SlotTable(max_loras)
        self.registry: dict[int, LoRARequest] = {}
        self._cache_keys: dict[int, bytes] = {}
        self._identities: dict[int, tuple[int, str]] = {}  # lora_int_id -> (KV events' lora_id, name)
        # add/remove come from the engine thread, step inputs from the forward thread when
        # steps overlap (async scheduling).
        self._lock = threading.Lock()

    # -- registry --------------------------------------------------------------------------------
    def add(self, request: LoRARequest) -> bool:
        """Registers and loads an adapter (ValueError naming the problem). False when this exact
        adapter is already registered."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request: expected a LoRARequest, got {type(request).__name__}")
        with self._lock:
            known = self.registry.get(request.lora_int_id)
            if known is not None:
                if known == request:
                    return False
                raise ValueError(f"lora_int_id: {request.lora_int_id} is already used by adapter "
                                 f"{known.lora_name!r} ({known.lora_path}); remove it first")
            for other in self.registry.values():
                if other.lora_name == request.lora_name:
                    raise ValueError(f"lora_name: {request.lora_name!r} is already loaded with id {other.lora_int_id}")
            self.worker.load(request)  # raises ValueError: nothing registered
            try:
                stable_id = adapter_id(request.lora_name, adapter_digest(request.lora_path))
            except OSError as exc:  # gone between the load and the digest
                self.worker.remove(request)
                raise ValueError(f"lora_path: cannot read {request.lora_path!r}: {exc}") from None
            self.registry[request.lora_int_id] = request
            self._identities[request.lora_int_id] = (stable_id, request.lora_name)
            self._cache_keys[request.lora_int_id] = cache_key(request.lora_name, stable_id)
            return True

    def remove(self, lora_int_id: int) -> bool:
        with self._lock:
            request = self.registry.pop(lora_int_id, None)
            if request is None:
                return False
            self._cache_keys.pop(lora_int_id, None)
            self._identities.pop(lora_int_id, None)
            self.slots.evict(lora_int_id)
            self.worker.remove(request)
            return True

    def pin(self, lora_int_id: int) -> bool:
        with self._lock:
            request = self.registry.get(lora_int_id)
            if request is None:
                return False
            self.worker.load(request)
            self.worker.pin(request)
            return True

    def get(self, lora_int_id: int) -> LoRARequest | None:
        return self.registry.get(lora_int_id)

    def list(self) -> set[int]:
        return set(self.registry)

    def cache_key(self, lora_int_id: int) -> bytes:
        return self._cache_keys[lora_int_id]

    def identity(self, lora_int_id: int) -> tuple[int, str] | None:
        """(lora_id, lora_name) as KV events publish them; None for an adapter not registered."""
        return self._identities.get(lora_int_id)

    # -- every step ------------------------------------------------------------------------------
    def step_input(self, seq_ids: Sequence[int], seq_tokens: Sequence[int]) -> LoRAStepInput | None:
        """The step's adapter layout from each scheduled sequence's adapter id (0: base) and
        token count; None when no sequence of the step uses an adapter."""
        if not any(seq_ids):
            return None
        with self._lock:
            slot_of, loads = self.slots.assign(seq_ids)
            layout = step_layout([slot_of[i] if i else -1 for i in seq_ids], seq_tokens, self.max_loras)
            return LoRAStepInput(layout, [(slot, self.registry[i]) for slot, i in loads])
