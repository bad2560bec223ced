"""LoRA adapters on one base model (vLLM's interface): many fine-tunes served from one set of base
weights, batched together in one step.

- `request.py`: `LoRARequest`, what a caller names an adapter with (torch-free);
- `peft.py`: a PEFT adapter directory read and checked against the model;
- `slots.py`: pure policy: device slots with LRU, the host cache, a step's token layout;
- `layers.py`: the linear layers' LoRA wrappers and the per-step batch they read;
- `worker.py`: one rank's adapters: host cache, device slots, activation before a step;
- `manager.py`: the engine's registry of adapters and its slot table (rank 0).

Only `LoRARequest` is imported here, so light consumers (the server's argument parsing) stay
torch-free.
"""

from kvserve.runtime.lora.request import LoRARequest

__all__ = ["LoRARequest"]
