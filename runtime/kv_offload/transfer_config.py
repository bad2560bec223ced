"""vLLM's ``--kv-transfer-config`` for its OffloadingConnector, mapped onto kvserve's offload flags.

    {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
     "kv_connector_extra_config": {"cpu_bytes_to_use": 1000000000, "block_size": 16}}

`cpu_bytes_to_use` is the tier's capacity (`kv_offload_bytes`); kvserve's own extra key
`kv_offload_dir` puts the tier in files (`kv_offload_dir`). Anything else that vLLM's connectors
take (other connectors, disaggregated prefill roles, `num_cpu_blocks`, tiering specs) is refused
with a message naming the key, so a config written for vLLM never half-applies.
"""

from __future__ import annotations

from typing import Any

from kvserve.runtime.options import json_object

CONNECTOR = "OffloadingConnector"
_TOP = {"kv_connector", "kv_role", "kv_connector_extra_config", "engine_id", "kv_connector_module_path"}
_EXTRA = {"cpu_bytes_to_use", "block_size", "spec_name", "kv_offload_dir"}


def parse_kv_transfer_config(value: Any, *, block_size: int) -> dict[str, Any]:
    """{"kv_offload_bytes": N, "kv_offload_dir": PATH | None} from a dict or its JSON string."""
    value = json_object(value, "kv_transfer_config", _TOP)
    if value.get("kv_connector") != CONNECTOR:
        raise ValueError(f"kv_transfer_config.kv_connector: only {CONNECTOR!r} (KV offloading) is supported, "
                         f"got {value.get('kv_connector')!r}")
    if value.get("kv_role", "kv_both") != "kv_both":
        raise ValueError(f"kv_transfer_config.kv_role: {CONNECTOR} stores and loads, so only 'kv_both', "
                         f"got {value.get('kv_role')!r}")
    if value.get("kv_connector_module_path") is not None:
        raise ValueError("kv_transfer_config.kv_connector_module_path: external connector modules are not loaded")
    extra = value.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise ValueError("kv_transfer_config.kv_connector_extra_config: expected an object")
    unknown = sorted(set(extra) - _EXTRA)
    if unknown:
        hint = " (give cpu_bytes_to_use instead)" if unknown[0] == "num_cpu_blocks" else ""
        raise ValueError(f"kv_transfer_config.kv_connector_extra_config.{unknown[0]}: not supported{hint}; "
                         f"supported: {sorted(_EXTRA)}")
    if extra.get("spec_name", "CPUOffloadingSpec") != "CPUOffloadingSpec":
        raise ValueError("kv_transfer_config.kv_connector_extra_config.spec_name: only 'CPUOffloadingSpec' "
                         f"(one tier; kv_offload_dir makes it a file tier), got {extra.get('spec_name')!r}")
    size = extra.get("cpu_bytes_to_use")
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ValueError("kv_transfer_config.kv_connector_extra_config.cpu_bytes_to_use: must be an integer > 0 "
                         f"(the tier's bytes per rank), got {size!r}")
    if "block_size" in extra and extra["block_size"] != block_size:
        raise ValueError("kv_transfer_config.kv_connector_extra_config.block_size: the tier stores the pool's "
                         f"blocks, so it must equal block_size {block_size}, got {extra['block_size']!r}")
    path = extra.get("kv_offload_dir")
    if path is not None and (not isinstance(path, str) or not path):
        raise ValueError("kv_transfer_config.kv_connector_extra_config.kv_offload_dir: must be a directory path")
    return {"kv_offload_bytes": size, "kv_offload_dir": path}
