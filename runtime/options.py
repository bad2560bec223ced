"""Engine options given as a dict or as the JSON object string a CLI flag carries
(speculative_config, kv_events_config, kv_transfer_config): one parser, one set of messages."""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any


def json_object(value: Any, field: str, known: Collection[str]) -> dict[str, Any]:
    """`value` as a dict with only `known` keys; a ValueError naming `field` (or `field.key`) if not."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{field}: not valid JSON ({exc.msg})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{field}: expected a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ValueError(f"{field}.{unknown[0]}: unknown key; known: {sorted(known)}")
    return value
