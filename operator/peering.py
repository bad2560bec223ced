"""Saying so when the peering object is missing: kopf then pauses the operator without a word.

A non-standalone operator handles nothing until kopf's peering object exists (kopf only logs a
keep-alive "not found" at debug level). `watch_peering` looks for the object the way kopf will,
and while it is missing logs one warning naming it and the two ways out, then again every
`interval` seconds; once the object appears it says so once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

log = logging.getLogger("kvserve.operator.peering")

REPEAT_SECONDS = 60.0


def peering_objects(name: str, namespaces: Sequence[str], clusterwide: bool) -> list[tuple[str, str | None]]:
    """(kind, namespace) of every peering object kopf needs: one cluster-wide with
    --all-namespaces, else one per plainly named namespace (globs cannot be listed here)."""
    if clusterwide:
        return [("ClusterKopfPeering", None)]
    return [("KopfPeering", ns) for ns in namespaces if not set("*?[!") & set(ns)]


def missing_message(name: str, kind: str, namespace: str | None) -> str:
    where = f" in namespace {namespace!r}" if namespace else ""
    fields = f"metadata.name {name!r}" + (f", metadata.namespace {namespace!r}" if namespace else "")
    example = "manifests/namespaced/peering.yaml" if namespace else "manifests/base/peering.yaml"
    return (f"peering object {kind} {name!r}{where} does not exist, so this operator is paused and handles "
            f"no InferenceService. Create it (apiVersion kopf.dev/v1, kind {kind}, {fields}; example: "
            f"{example}; CRDs: crds/kopf-peering.yaml), or run the operator with --standalone if it is "
            f"the only one.")


async def watch_peering(exists: Callable[[str, str | None], Awaitable[bool]], name: str,
                        targets: Sequence[tuple[str, str | None]], *, interval: float = REPEAT_SECONDS,
                        first_delay: float = 5.0, logger: logging.Logger = log) -> None:
    """Runs until cancelled. `exists(kind, namespace)` says whether the object is there; an error
    from it counts as "don't know" and is retried at the next check."""
    await asyncio.sleep(first_delay)  # kopf's own first keep-alive may be about to create state
    missing: set[tuple[str, str | None]] = set()
    while True:
        for kind, namespace in targets:
            try:
                present = await exists(kind, namespace)
            except Exception as error:  # unknown, not missing: say nothing this round
                logger.debug("cannot check peering object %s %s: %s", kind, namespace, error)
                continue
            key = (kind, namespace)
            if not present:
                logger.warning(missing_message(name, kind, namespace))
                missing.add(key)
            elif key in missing:
                logger.warning(f"peering object {kind} {name!r} found"
                               + (f" in namespace {namespace!r}" if namespace else "") + "; the operator resumes")
                missing.discard(key)
        await asyncio.sleep(interval)
