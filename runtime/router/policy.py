"""Which pod serves a request: pure, deterministic, no I/O (the router's functional core).

A request is reduced to its *prefix chunks*: the prompt (token ids, or the text of a completion
or of a chat's messages) cut into fixed-size chunks, each hashed together with everything before
it, so chunk i's hash names the whole prefix up to and including chunk i. Runtimes cache KV in
blocks of the same kind (a block's hash covers its prefix), so a pod that served a prompt with
chunks h0..h5 very likely still holds the KV of that prefix.

Policies:
  * `prefix` (default): each pod is scored by what going there saves against what it costs
    (`affinity_scores`): the fraction of the prompt's prefix it holds (by its KV events, pool
    and tier blocks weighted; else by what it served recently) minus `load_weight` x the
    requests it carries. The best-scoring pod wins the request by affinity only when it beats
    the pod a new prompt would get by at least `prefix_margin` of the prompt, both in held
    prefix and in score (`affinity_pick`): a conversation's history, a long shared document.
    Anything else (a new prompt, or one sharing only a short prefix such as a system prompt
    that every pod soon holds) goes where consistent hashing with bounded load puts it
    (Mirrokni et al.): the ring position of the whole prompt, skipping pods that already carry
    more than `balance_factor` x the mean load (rounded down, but at least the least loaded
    pod's load + 1: `bounded_capacity`), so identical prompts land together while no pod takes
    more than its share. A request that starts a conversation (sessions.py: it extends no
    earlier request) also keeps to the same bound over the conversations each pod keeps,
    without slack, on the ring and by affinity (when no pod is under both, to the pod under the
    load bound that keeps the fewest): between a chat's turns every pod looks idle, and
    in-flight load alone sent every new conversation to the pod holding their shared system
    prompt. A pod whose agent reports a queue or KV use over the thresholds
    takes nothing by affinity (unless every pod is over them).
  * `least-load`: the pod with the fewest requests in flight (the router's own count plus what
    the agent reports beyond this router's requests: `EndpointLoad.busy`), then the lowest KV use.
  * `round-robin`: each ready pod in turn (what a plain Service does, for comparison).

A request whose `model` names a LoRA adapter (multi-LoRA serving) is placed among the pods that
report the adapter loaded, by the same policy and the same load bound (computed over those
pods): a pod without the adapter could only answer 404. Its prefix chunks are hashed under the
adapter's name, because the same prompt under another adapter (or the base model) has other KV.
When no pod reports the adapter (signals not in yet, or an unknown name) every pod is a
candidate, and the pod's own answer decides.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .kv_index import PreciseMatch
from .sessions import SessionTable

POLICIES = ("prefix", "least-load", "round-robin")

# Decision labels (metrics, logs, the X-Kvserve-Route header).
PREFIX_HIT = "prefix-hit"
PREFIX_NEW = "prefix-new"
OVERLOADED = "overloaded-fallback"
LEAST_LOAD = "least-load"
ROUND_ROBIN = "round-robin"
DECISIONS = (PREFIX_HIT, PREFIX_NEW, OVERLOADED, LEAST_LOAD, ROUND_ROBIN)

# Hashing a very long prompt costs ~1 us per chunk; past this many chunks the prefix is long
# enough to tell conversations apart.
MAX_CHUNKS = 4096


@dataclass(frozen=True)
class PolicyConfig:
    policy: str = "prefix"
    block_tokens: int = 16  # chunk size for token-id prompts: the runtime's KV block size
    chunk_chars: int = 64  # chunk size for text (about block_tokens tokens of English)
    balance_factor: float = 1.25  # bounded load: no pod above this x the mean in-flight count
    max_queue_depth: float = 8.0  # the best-match pod is overloaded above this many waiting
    max_kv_utilization: float = 0.95  # ... or above this KV use (0..1)
    # Affinity (see affinity_pick): a pod must beat the new-prompt placement by this fraction of
    # the prompt, and each request it carries costs it `load_weight` of a whole prompt's prefill.
    # 0.02 / 0.1 from bench/router_sweep.py (docs/benchmarks.md): a small margin lets any held
    # advantage win while loads are equal (one request more outweighs up to 0.1 of the prompt);
    # a load weight of 0.3 broke conversations apart with 6 in flight, 0 bought nothing.
    prefix_margin: float = 0.02
    load_weight: float = 0.1
    prefix_ttl_seconds: float = 600.0  # how long "served recently" lasts
    # A conversation not continued for this long no longer counts as kept by its pod (sessions.py).
    session_ttl_seconds: float = 300.0
    index_capacity: int = 200_000  # prefix chunks remembered (LRU), over all pods

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"policy: unknown policy {self.policy!r}; supported: {', '.join(POLICIES)}")
        for name, low in (("block_tokens", 1), ("chunk_chars", 1), ("index_capacity", 1)):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < low:
                raise ValueError(f"{name}: must be an integer >= {low}, got {getattr(self, name)!r}")
        if not self.balance_factor >= 1.0:
            raise ValueError(f"balance_factor: must be >= 1, got {self.balance_factor!r}")
        if not self.max_queue_depth >= 0:
            raise ValueError(f"max_queue_depth: must be >= 0, got {self.max_queue_depth!r}")
        if not 0 < self.max_kv_utilization <= 1:
            raise ValueError(f"max_kv_utilization: must be in (0, 1], got {self.max_kv_utilization!r}")
        if not 0 < self.prefix_margin <= 1:
            raise ValueError(f"prefix_margin: must be in (0, 1], got {self.prefix_margin!r}")
        if not 0 <= self.load_weight <= 1:
            raise ValueError(f"load_weight: must be in [0, 1], got {self.load_weight!r}")
        if not self.prefix_ttl_seconds > 0:
            raise ValueError(f"prefix_ttl_seconds: must be > 0, got {self.prefix_ttl_seconds!r}")
        if not self.session_ttl_seconds > 0:
            raise ValueError(f"session_ttl_seconds: must be > 0, got {self.session_ttl_seconds!r}")


# --- request -> prefix chunks -----------------------------------------------------------------

def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: the text ones carry the prefix
        parts = []
        for part in content:
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                parts.append(repr(part))
        return "".join(parts)
    return "" if content is None else repr(content)


def chat_text(messages: Sequence[Any]) -> str:
    """A chat's messages as one string that only grows as the conversation does: the request of
    turn n+1 starts with the string of turn n's request (plus its answer)."""
    out = []
    for message in messages:
        if not isinstance(message, Mapping):
            out.append(repr(message))
            continue
        out.append(f"{message.get('role', '')}\x1f{_content_text(message.get('content'))}\x1e")
    return "".join(out)


def routing_key(route: str, body: Mapping[str, Any]) -> str | list[int] | None:
    """What a request's prefix is: token ids, text, or None (nothing to route on)."""
    if route == "chat":
        messages = body.get("messages")
        return chat_text(messages) if isinstance(messages, list) and messages else None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        prompt = prompt[0]  # a batch of prompts goes to one pod: route on the first
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    return None


def chunk_hashes(key: str | Sequence[int] | None, *, block_tokens: int = 16, chunk_chars: int = 64,
                 max_chunks: int = MAX_CHUNKS, adapter: str | None = None) -> list[int]:
    """Chained 64-bit hashes of the key's full chunks (a key shorter than one chunk gives one
    hash of the whole key, so a short prompt still has a home). blake2b, not hash(): every
    router replica and every restart must agree. `adapter` (a LoRA adapter's name) seeds the
    chain, so one prompt under two adapters never shares an entry; None leaves the base model's
    hashes as they always were."""
    if key is None:
        return []
    if isinstance(key, str):
        data = key.encode("utf-8", "surrogatepass")
        size = chunk_chars
        chunks = [key[i:i + size].encode("utf-8", "surrogatepass") for i in range(0, len(key) - size + 1, size)]
        tag = b"t"
    else:
        size = block_tokens
        chunks = [b",".join(str(t).encode() for t in key[i:i + size]) for i in range(0, len(key) - size + 1, size)]
        data = b",".join(str(t).encode() for t in key)
        tag = b"i"
    if not chunks:
        chunks = [data]
    if adapter is not None:
        tag += b"\x00lora\x00" + adapter.encode("utf-8", "surrogatepass")
    out = []
    digest = tag
    for chunk in chunks[:max_chunks]:
        digest = hashlib.blake2b(digest + b"\x00" + chunk, digest_size=8).digest()
        out.append(int.from_bytes(digest, "big"))
    return out


# --- what the router knows about each pod ----------------------------------------------------

@dataclass(frozen=True)
class EndpointLoad:
    in_flight: int = 0  # requests this router has open to the pod
    running: float = 0.0  # from the pod's agent (all routers and direct clients)
    queue_depth: float = 0.0
    kv_cache_utilization: float = 0.0
    fresh: bool = False  # the agent answered recently; stale signals count as zero
    # The most requests this router had open to the pod while the agent's sample was being taken
    # (None: not known). The sample counts those too, so only its excess over them is other
    # clients' load.
    own_at_sample: float | None = None

    def busy(self) -> float:
        """The pod's requests: this router's own count, exact now, plus what the agent reports
        beyond the requests of this router it counted. A sample is up to a poll interval old
        (plus a step, on the pod), so taken as it is it still counts requests this router has
        seen finish: an idle pod looked busy, and new conversations arriving together doubled up
        on another pod (two on one pod and none on a third in most rounds of
        bench/router_events.py)."""
        agent = self.running + self.queue_depth if self.fresh else 0.0
        if self.own_at_sample is None:
            return max(float(self.in_flight), agent)
        return self.in_flight + max(0.0, agent - self.own_at_sample)

    def score(self) -> tuple[float, float]:
        return self.busy(), (self.kv_cache_utilization if self.fresh else 0.0)


def overloaded(load: EndpointLoad, config: PolicyConfig) -> bool:
    return load.fresh and (load.queue_depth > config.max_queue_depth
                           or load.kv_cache_utilization > config.max_kv_utilization)


# --- prefix index ----------------------------------------------------------------------------

class PrefixIndex:
    """chunk hash -> {pod: last time it served a prompt with that prefix}, LRU-bounded."""

    def __init__(self, capacity: int = 200_000, ttl: float = 600.0):
        self.capacity, self.ttl = capacity, ttl
        self._entries: OrderedDict[int, dict[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, hashes: Sequence[int], pod: str, now: float) -> None:
        # Reversed: the first chunks end up most recently used, so LRU eviction trims a prefix
        # from its tail and never leaves a long match without its start.
        for h in reversed(hashes):
            entry = self._entries.pop(h, None) or {}
            entry[pod] = now
            self._entries[h] = entry
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def match(self, hashes: Sequence[int], pods: Iterable[str], now: float) -> dict[str, int]:
        """pod -> number of leading chunks it served within the TTL (pods without a match absent)."""
        alive = set(pods)
        lengths: dict[str, int] = {}
        for i, h in enumerate(hashes):
            entry = self._entries.get(h)
            if not entry:
                break
            holders = [p for p, t in entry.items() if p in alive and now - t <= self.ttl]
            if not holders:
                break
            for p in holders:
                lengths[p] = i + 1
        return lengths

    def forget(self, pod: str) -> None:
        """A pod that went away: its cache went with it."""
        for h in list(self._entries):
            entry = self._entries[h]
            if entry.pop(pod, None) is not None and not entry:
                del self._entries[h]


# --- consistent hashing ----------------------------------------------------------------------

class HashRing:
    """Each pod at `vnodes` points of a 64-bit ring; a key walks clockwise from its point."""

    def __init__(self, names: Iterable[str], vnodes: int = 64):
        points = []
        for name in sorted(set(names)):
            for v in range(vnodes):
                h = hashlib.blake2b(f"{name}#{v}".encode(), digest_size=8).digest()
                points.append((int.from_bytes(h, "big"), name))
        points.sort()
        self._keys = [p for p, _ in points]
        self._names = [n for _, n in points]
        self.names = tuple(sorted(set(names)))

    def walk(self, key: int) -> Iterator[str]:
        """Every pod once, in ring order from the key's point."""
        if not self._keys:
            return
        start = bisect.bisect_left(self._keys, key % (1 << 64))
        seen: set[str] = set()
        n = len(self._keys)
        for i in range(n):
            name = self._names[(start + i) % n]
            if name not in seen:
                seen.add(name)
                yield name
                if len(seen) == len(self.names):
                    return


def bounded_capacity(loads: Mapping[str, EndpointLoad], pods: Sequence[str], factor: float) -> float:
    """The most requests one pod may carry once this one is added: factor x the mean, rounded
    down, but never below the least loaded pod's load + 1 (so some pod always has room).
    Mirrokni et al. round up, which at a few requests lets one pod take a second while another
    has none (3 new conversations on 3 pods: ceil(1.25 x 3 / 3) = 2, a 2-1-0 split in 60% of
    bench/router_events.py's rounds), and a conversation's affinity then keeps both on that pod
    for every later turn while the third pod idles."""
    return _bound([loads.get(p, EndpointLoad()).busy() for p in pods], factor)


def _bound(counts: Sequence[float], factor: float) -> float:
    return max(min(counts) + 1, math.floor(factor * (sum(counts) + 1) / len(counts)))


# --- the decision ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Choice:
    pod: str
    decision: str
    matched_chunks: int = 0  # leading chunks the chosen pod had served
    total_chunks: int = 0


@dataclass
class PolicyState:
    """What a policy remembers between requests (the router's one mutable piece of routing)."""

    config: PolicyConfig
    index: PrefixIndex = field(init=False)
    sessions: SessionTable = field(init=False)
    ring: HashRing = field(init=False)
    turn: int = 0  # round-robin position, also breaks least-load ties in turn

    def __post_init__(self):
        self.index = PrefixIndex(self.config.index_capacity, self.config.prefix_ttl_seconds)
        # A conversation costs ~220 bytes here (tracemalloc) against ~330 for a prefix chunk, and
        # spans many chunks: a quarter as many keeps the table within a sixth of the index's
        # memory budget (limits.prefix_index_capacity) even when every prompt is one chunk.
        self.sessions = SessionTable(self.config.session_ttl_seconds, max(1, self.config.index_capacity // 4))
        self.ring = HashRing(())

    def set_pods(self, names: Iterable[str]) -> None:
        names = tuple(sorted(set(names)))
        if names != self.ring.names:
            gone = set(self.ring.names) - set(names)
            self.ring = HashRing(names)
            for pod in gone:
                self.index.forget(pod)
                self.sessions.forget(pod)

    def record(self, hashes: Sequence[int], pod: str, now: float) -> None:
        if self.config.policy == "prefix" and hashes:
            self.index.record(hashes, pod, now)
            self.sessions.record(hashes, pod, now)


def adapter_of(body: Mapping[str, Any], adapters: Mapping[str, frozenset[str]]) -> str | None:
    """The LoRA adapter a request names in `model`, when some pod reports it loaded
    (`adapters`: pod -> its loaded adapters); None for the base model or a name no pod knows."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        return None
    return model if any(model in names for names in adapters.values()) else None


def adapter_holders(adapter: str | None, pods: Iterable[str], adapters: Mapping[str, frozenset[str]]) -> list[str]:
    """The pods to place a request among: those with its adapter loaded, or all of them when
    there is no adapter or no pod reports it."""
    pods = list(pods)
    if adapter is None:
        return pods
    holders = [p for p in pods if adapter in adapters.get(p, ())]
    return holders or pods


def _least_loaded(pods: Sequence[str], loads: Mapping[str, EndpointLoad], turn: int) -> str:
    # Ties (an idle service) go in turn, so a burst at idle does not all land on one pod.
    n = len(pods)
    rotated = [pods[(turn + i) % n] for i in range(n)]
    return min(rotated, key=lambda p: loads.get(p, EndpointLoad()).score())


def prefix_fractions(served: Mapping[str, int], total_chunks: int, precise: PreciseMatch | None,
                     pods: Iterable[str]) -> dict[str, float]:
    """pod -> fraction of the prompt's prefix it holds (pods holding none absent). A pod whose KV
    events are trusted is ranked by the blocks it holds now (kv_index.py); the others by what
    they served recently (the approximate index), at least what a partial event index shows."""
    out = {p: n / total_chunks for p, n in served.items()} if total_chunks else {}
    if precise is None or not precise.total_blocks:
        return out
    if not any(v > 0 for v in (*precise.held.values(), *precise.partial.values())):
        # Not even the first block anywhere: a new prompt, one evicted everywhere, or one the router
        # hashed differently from the pods (another chat template, an option it does not know).
        # The served-based index is right about the first and no worse about the others.
        return out
    for p in pods:
        if p in precise.held:
            held = precise.held[p] / precise.total_blocks
            if held > 0:
                out[p] = held
            else:
                out.pop(p, None)
        elif precise.partial.get(p, 0) > 0:
            out[p] = max(out.get(p, 0.0), precise.partial[p] / precise.total_blocks)
    return out


def affinity_scores(fractions: Mapping[str, float], pods: Iterable[str], loads: Mapping[str, EndpointLoad],
                    load_weight: float) -> dict[str, float]:
    """pod -> the fraction of the prompt's prefill it saves minus `load_weight` per request it
    carries: a weighted sum in units of this prompt's prefill (a request ahead costs a pod about
    a prompt's worth of work on its cores, whatever the prompt's length)."""
    return {p: fractions.get(p, 0.0) - load_weight * loads.get(p, EndpointLoad()).busy() for p in pods}


def affinity_pick(fractions: Mapping[str, float], pods: Sequence[str], base: str, loads: Mapping[str, EndpointLoad],
                  config: PolicyConfig, turn: int = 0) -> str | None:
    """The pod worth sending the request to for what it holds, or None (`base`, where a new
    prompt would go, stands). The best-scoring pod must hold at least `prefix_margin` of the
    prompt more than `base` (a held prefix that every pod has, such as a system prompt, moves
    nothing) and still score `prefix_margin` above it once load counts (a pod far busier than
    `base` is not worth its cache). Ties go to the least loaded, then in turn."""
    if not pods:
        return None
    scores = affinity_scores(fractions, set(pods) | {base}, loads, config.load_weight)
    n = len(pods)
    rotated = [pods[(turn + i) % n] for i in range(n)]
    best = max(rotated, key=lambda p: (scores[p], -loads.get(p, EndpointLoad()).busy()))
    margin = config.prefix_margin - 1e-9
    if fractions.get(best, 0.0) - fractions.get(base, 0.0) >= margin and scores[best] - scores[base] >= margin:
        return best
    return None


def choose(state: PolicyState, hashes: Sequence[int], pods: Sequence[str], loads: Mapping[str, EndpointLoad],
           now: float, exclude: Iterable[str] = (), precise: PreciseMatch | None = None, *,
           adapter: str | None = None, adapters: Mapping[str, frozenset[str]] | None = None) -> Choice | None:
    """The pod for a request, or None when no pod is left (all excluded, or none ready).

    `pods` are the ready pods; `exclude` the ones this request already failed on; `precise` what
    the pods' KV events say they hold of this prompt (None: served-based only); `adapter` the
    LoRA adapter the request names and `adapters` each pod's loaded adapters (module docstring).
    """
    skip = set(exclude)
    candidates = sorted(p for p in set(pods) if p not in skip)
    candidates = adapter_holders(adapter, candidates, adapters or {})
    if not candidates:
        return None
    config = state.config
    state.turn += 1
    total = len(hashes)
    if config.policy == "round-robin":
        return Choice(candidates[state.turn % len(candidates)], ROUND_ROBIN, 0, total)
    if config.policy == "least-load" or not hashes:
        return Choice(_least_loaded(candidates, loads, state.turn), LEAST_LOAD, 0, total)

    def load(p: str) -> EndpointLoad:
        return loads.get(p, EndpointLoad())

    usable = [p for p in candidates if not overloaded(load(p), config)]
    fractions = prefix_fractions(state.index.match(hashes, candidates, now), total, precise, candidates)

    def chunks(p: str) -> int:
        return round(fractions.get(p, 0.0) * total)

    # Where a new prompt goes: the ring position of the whole prompt, skipping pods at the load
    # bound, so identical prompts land together and new conversations spread. A request that
    # starts a conversation (continues no session the router saw) also skips pods that already
    # keep more than their share of conversations (the same bound over sessions.py's counts), and
    # wins no pod above that share by affinity: what it shares with them is a prefix every
    # conversation has (a system prompt), which a pod without it computes once, while a pod that
    # keeps too many conversations evicts their histories (bench/router_events.py --think-seconds).
    # Counts first, before the load bound, was worse in bursts: the counts still hold finished
    # conversations, and live ones then differed by 3 over 3 pods (tests/test_router_policy.py).
    cap = bounded_capacity(loads, candidates, config.balance_factor)
    own = state.sessions.continued(hashes)
    new_session = own is None
    sessions = state.sessions.counts(candidates, now, own)
    # No slack over the mean here (balance factor 1): conversations end silently, so the counts
    # still hold finished ones until --session-ttl, and with slack the new conversations filled
    # it on the pods the ring favours (3-3-0 over 3 pods whose earlier 12 were spread 4-4-4).
    session_cap = _bound(list(sessions.values()), 1.0)

    # When no pod is under both bounds the in-flight one wins: a pod over it is busy now (with
    # other clients' work too, which no conversation count sees). Among the pods under it a new
    # conversation takes the one keeping the fewest (ring order breaks ties), so a burst of new
    # conversations does not undo the spread (ring order alone: 2-3-4 in 67% of simulated bursts).
    ring = state.ring if set(candidates) <= set(state.ring.names) else HashRing(candidates)
    order = [p for p in ring.walk(hashes[-1]) if p in usable and load(p).busy() + 1 <= cap]
    if new_session:
        base = next((p for p in order if sessions[p] + 1 <= session_cap), None)
        if base is None and order:
            base = min(order, key=lambda p: sessions[p])  # min() keeps the first of equals
    else:
        base = next(iter(order), None)
    fallback = base or _least_loaded(usable or candidates, loads, state.turn)
    # Every pod over its thresholds: the cache still helps, so they all compete by affinity.
    rivals = usable or candidates
    if new_session:
        rivals = [p for p in rivals if sessions[p] + 1 <= session_cap] or rivals
    best = affinity_pick(fractions, rivals, fallback, loads, config, state.turn)
    # The conversation counts where it goes from now, not from its first answer: new conversations
    # arriving while others' first requests are still in flight would not see those.
    if best is not None:
        state.sessions.record(hashes, best, now)
        return Choice(best, PREFIX_HIT, chunks(best), total)
    top = max(fractions.values(), default=0.0)
    holders_overloaded = top > 0 and all(p not in usable for p, f in fractions.items() if f >= top - 1e-9)
    if base is not None and top >= config.prefix_margin and fractions.get(base, 0.0) >= top - 1e-9:
        decision = PREFIX_HIT  # the ring's pod is the one holding the prompt anyway
    else:
        decision = PREFIX_NEW if base is not None and not holders_overloaded else OVERLOADED
    state.sessions.record(hashes, fallback, now)
    return Choice(fallback, decision, chunks(fallback), total)
