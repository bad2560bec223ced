"""The pod's LoRA adapters: the agent keeps what the runtime has loaded equal to a desired list.

The list is a JSON file, `[{"name": ..., "uri": ...}]`: the operator's ConfigMap, mounted into
the pod, which the kubelet rewrites in place when spec.adapters changes, so adding or removing
an adapter never touches the pod template (no restart). Each adapter is fetched beside the model
(`fetch(..., adapter=True)`: hf://org/name[@rev] or a path) into `<adapters dir>/<name>`, then
loaded through the runtime's admin route `POST /v1/load_lora_adapter`; one dropped from the list
is unloaded (`POST /v1/unload_lora_adapter`) and its files removed.

A bad adapter (a fetch that fails, a rank above --max-lora-rank, target modules the model lacks,
another base model) is reported in /v1/signals (`adapters.failed`, which the operator turns into
a status condition and an Event) and never stops the others or the runtime. The runtime's refusal
(a 4xx) is final for that uri; a fetch failure or a runtime that cannot be reached is tried again
with backoff. The plan (what to load, unload, retry) is the pure `plan`; `AdapterSync` is the I/O.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import shutil
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("kvserve.agent")

# The operator's bound (crds/: spec.adapters maxItems); a longer file is refused whole.
MAX_ADAPTERS = 256
MAX_FILE_BYTES = 256 * 1024
# A name is a directory under the adapters dir and a `model` value clients send.
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
RETRY_MIN_S = 5.0
RETRY_MAX_S = 300.0

LOADED, FAILED, PENDING = "loaded", "failed", "pending"
# vLLM's (and kvserve's) answer to a load of a name the runtime already serves.
ALREADY_LOADED = "has already been loaded"


@dataclass(frozen=True)
class Desired:
    name: str
    uri: str


def parse_desired(text: str) -> list[Desired]:
    """The desired list, checked whole (ValueError naming the entry): a half-read list would
    unload adapters that are still wanted."""
    if len(text.encode()) > MAX_FILE_BYTES:
        raise ValueError(f"adapters: the list is larger than {MAX_FILE_BYTES} bytes")
    try:
        raw = json.loads(text) if text.strip() else []
    except ValueError as exc:
        raise ValueError(f"adapters: not JSON ({exc})") from None
    if not isinstance(raw, list):
        raise ValueError("adapters: must be a JSON list of {name, uri}")
    if len(raw) > MAX_ADAPTERS:
        raise ValueError(f"adapters: {len(raw)} entries, at most {MAX_ADAPTERS}")
    out: list[Desired] = []
    seen: set[str] = set()
    for i, item in enumerate(raw):
        if not isinstance(item, Mapping):
            raise ValueError(f"adapters[{i}]: must be an object with name and uri")
        name, uri = item.get("name"), item.get("uri")
        if not isinstance(name, str) or not NAME.match(name):
            raise ValueError(f"adapters[{i}].name: {name!r} is not a name (letters, digits, . _ -; at most 128)")
        if not isinstance(uri, str) or not uri.strip() or len(uri) > 1024:
            raise ValueError(f"adapters[{i}].uri: must be a non-empty string of at most 1024 characters")
        if name in seen:
            raise ValueError(f"adapters[{i}].name: {name!r} is listed twice")
        seen.add(name)
        out.append(Desired(name, uri))
    return out


@dataclass
class AdapterState:
    """What the agent did with one adapter: `status` is loaded, failed or pending."""

    uri: str
    status: str = PENDING
    message: str | None = None
    retry_at: float | None = None  # a retryable failure: when to try again (None: final)
    attempts: int = 0
    # When the runtime confirmed the load (the agent's clock): a metrics sample requested before
    # then cannot show the adapter yet, so its absence there says nothing.
    loaded_at: float | None = None


def backoff(attempts: int) -> float:
    return min(RETRY_MAX_S, RETRY_MIN_S * 2 ** max(0, attempts - 1))


def plan(desired: Iterable[Desired], state: Mapping[str, AdapterState], now: float,
         engine_loaded: Iterable[str] | None = None,
         engine_seen_at: float | None = None) -> tuple[list[Desired], list[str]]:
    """(adapters to load, names to unload). Unloads come first: an adapter gone from the list,
    or one whose uri changed (it is then loaded again from the new uri). `engine_loaded` is the
    runtime's own list when known, as requested at `engine_seen_at`: an adapter the agent loaded
    but the runtime no longer has (the runtime container restarted) is loaded again, unless that
    list was asked for before the load was confirmed (a stale scrape)."""
    want = {d.name: d for d in desired}
    engine = None if engine_loaded is None else set(engine_loaded)
    unload = sorted(n for n, s in state.items()
                    if n not in want or s.uri != want[n].uri)
    load = []
    for name, d in want.items():
        s = state.get(name)
        if s is None or s.uri != d.uri:
            load.append(d)
        elif (s.status == LOADED and engine is not None and name not in engine
              and (engine_seen_at is None or s.loaded_at is None or engine_seen_at > s.loaded_at)):
            load.append(d)
        elif s.status == FAILED and s.retry_at is not None and now >= s.retry_at:
            load.append(d)
        elif s.status == PENDING:
            load.append(d)
    return load, unload


def report(desired: Iterable[Desired] | None, state: Mapping[str, AdapterState], error: str | None) -> dict | None:
    """The `adapters` field of /v1/signals (None when the pod has no adapter list)."""
    if desired is None and error is None:
        return None
    names = [d.name for d in desired or ()]
    loaded = sorted(n for n in names if n in state and state[n].status == LOADED)
    failed = {n: state[n].message or "failed" for n in names if n in state and state[n].status == FAILED}
    pending = sorted(n for n in names if n not in loaded and n not in failed)
    return {"desired": len(names), "loaded": loaded, "failed": failed, "pending": pending,
            "synced": not pending and error is None, "error": error}


class LoadRefused(Exception):
    """The runtime answered a load with a 4xx: the adapter itself is wrong (final for this uri)."""


class Unreachable(Exception):
    """The runtime could not be asked (not up yet, restarting): try again later."""


@dataclass
class AdapterSync:
    """The shell: reads the list, fetches, and calls the runtime's admin routes. `runtime` is an
    object with async `load(name, path)` and `unload(name)` (AgentRuntimeClient in app.py)."""

    list_file: str
    adapters_dir: str
    runtime: object
    clock: Callable[[], float] = time.monotonic
    state: dict[str, AdapterState] = field(default_factory=dict)
    desired: list[Desired] | None = None
    error: str | None = None
    # The list's identity: the kubelet swaps a new file in (a new inode), and two writes within
    # the filesystem's mtime resolution must not look like one.
    _mtime: tuple[int, int, int] | None = None

    def read_list(self) -> None:
        path = Path(self.list_file)
        try:
            stat = path.stat()
        except FileNotFoundError:
            self.desired, self.error = [], None  # no list yet: no adapters
            return
        stamp = (stat.st_mtime_ns, stat.st_ino, stat.st_size)
        if stamp == self._mtime and self.desired is not None:
            return
        try:
            self.desired = parse_desired(path.read_text())
            self.error = None
            self._mtime = stamp
        except (OSError, ValueError) as exc:  # keep the last good list; say what is wrong
            self.error = str(exc)

    def report(self) -> dict | None:
        return report(self.desired, self.state, self.error)

    @property
    def settled(self) -> bool:
        """Every listed adapter was tried: loaded, or failed and reported (the pod may serve)."""
        r = self.report()
        return r is None or not r["pending"]

    async def sync_once(self, now: float, engine_loaded: Iterable[str] | None = None,
                        engine_seen_at: float | None = None) -> None:
        await asyncio.to_thread(self.read_list)
        load, unload = plan(self.desired or [], self.state, now, engine_loaded, engine_seen_at)
        kept = set()  # not unloaded this round: loading the name again would meet the old one
        for name in unload:
            try:
                await self.runtime.unload(name)
            except Unreachable as exc:
                log.warning("adapter %s: cannot unload now (%s)", name, exc)
                kept.add(name)
                continue
            except LoadRefused:
                pass  # not loaded there (e.g. it had failed): nothing to undo
            self.state.pop(name, None)
            await asyncio.to_thread(shutil.rmtree, Path(self.adapters_dir) / name, True)
            log.info("adapter %s: unloaded", name)
        for d in load:
            if d.name not in kept:
                await self._load(d, now, engine_loaded)

    async def _load(self, d: Desired, now: float, engine_loaded: Iterable[str] | None = None) -> None:
        from .fetch import FetchError, fetch

        s = self.state.get(d.name)
        if s is None and engine_loaded is not None and d.name in set(engine_loaded):
            # The agent restarted beside a runtime that kept its adapters: take them as they are.
            self.state[d.name] = AdapterState(d.uri, LOADED)
            return
        if s is None or s.uri != d.uri:
            s = self.state[d.name] = AdapterState(d.uri)
        s.attempts += 1
        dest = str(Path(self.adapters_dir) / d.name)
        try:
            await asyncio.to_thread(fetch, d.uri, dest, adapter=True)
        except FetchError as exc:
            s.status, s.message, s.retry_at = FAILED, f"fetch: {exc}", now + backoff(s.attempts)
            log.warning("adapter %s: %s", d.name, s.message)
            return
        try:
            await self.runtime.load(d.name, dest)
        except LoadRefused as exc:
            if ALREADY_LOADED in str(exc):
                # The runtime kept it from a load whose answer the agent lost (a timeout) or that
                # a stale list made it repeat: it serves this name, from this directory.
                s.status, s.message, s.retry_at, s.attempts, s.loaded_at = LOADED, None, None, 0, self.clock()
                log.info("adapter %s: already loaded in the runtime", d.name)
                return
            s.status, s.message, s.retry_at = FAILED, str(exc), None
            log.warning("adapter %s: refused by the runtime: %s", d.name, exc)
            return
        except Unreachable as exc:
            s.status, s.message, s.retry_at = PENDING, str(exc), None
            return
        s.status, s.message, s.retry_at, s.attempts, s.loaded_at = LOADED, None, None, 0, self.clock()
        log.info("adapter %s: loaded from %s", d.name, d.uri)
