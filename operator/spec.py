"""An InferenceService's spec as typed, validated dataclasses.

The CRD's schema already defaults and bounds most fields, but the operator cannot rely on it: an
older CRD, an emulator without validation, or a hand-made object may reach it unchecked. So this
parser applies the same defaults and rules again, and every error names the field it is about.
`crds/inferenceservices.kvserve.dev.yaml` and this module must agree (a test checks that).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvserve.runtime.capacity import (
    KV_CACHE_DTYPES,
    WEIGHT_FORMATS,
    ModelShape,
    WeightFormat,
    weight_bytes_per_gpu,
    weight_format,
)
from kvserve.runtime.weight_formats import checkpoint_format

GROUP = "kvserve.dev"
VERSION = "v1alpha1"
PLURAL = "inferenceservices"
KIND = "InferenceService"
API_VERSION = f"{GROUP}/{VERSION}"

ENGINES = ("kvserve", "vllm")
DTYPES = ("auto", "float16", "bfloat16", "float32")
QUANTIZATIONS = WEIGHT_FORMATS  # vLLM's names; unset: the checkpoint's own (or full precision)
BLOCK_SIZES = (8, 16, 32, 64, 128)
TP_DEGREES = (1, 2, 4, 8, 16, 32, 64)
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
ROUTER_POLICIES = ("prefix", "least-load", "round-robin")  # kvserve.runtime.router.policy.POLICIES
DEFAULT_IMAGE = "ghcr.io/kvserve/kvserve:0.1.0"

_URI = re.compile(r"^(hf://[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?(/[\w./-]+\.gguf)?|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/.*)?|file:///.+|/.+)$")
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$")
_SUFFIX = {None: 1, "Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "Ti": 1024**4, "Pi": 1024**5,
           "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15}
GIB = 1024**3
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_SUBDOMAIN = re.compile(r"^(?=.{1,253}$)[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")  # e.g. a StorageClass name
_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
# Credentials that would sit in plain text in the InferenceService (readable by anyone who can get
# it, and copied into every Deployment and ReplicaSet): each has a Secret reference instead.
SECRET_ENV = {
    "KVSERVE_API_KEY": "spec.runtime.apiKeySecret",
    "VLLM_API_KEY": "spec.runtime.apiKeySecret",
    "KVSERVE_ADMIN_API_KEY": "spec.runtime.adminApiKeySecret",
    "HF_TOKEN": "spec.model.hfTokenSecret",
    "HUGGING_FACE_HUB_TOKEN": "spec.model.hfTokenSecret",
}
SECRET_ARGS = {"--api-key": "spec.runtime.apiKeySecret", "--admin-api-key": "spec.runtime.adminApiKeySecret"}


class SpecError(ValueError):
    """A spec the operator cannot serve; `field` is the dotted path of the offending field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def parse_quantity(value: Any, field: str) -> int:
    """A Kubernetes memory quantity ("80Gi", "24G", 1024) in bytes."""
    if isinstance(value, bool):
        raise SpecError(field, f"must be a quantity such as '80Gi', got {value!r}")
    if isinstance(value, (int, float)):
        number, suffix = float(value), None
    else:
        match = _QUANTITY.match(str(value).strip())
        if not match:
            raise SpecError(field, f"must be a quantity such as '80Gi', got {value!r}")
        number, suffix = float(match.group(1)), match.group(2)
    result = int(number * _SUFFIX[suffix])
    if result <= 0:
        raise SpecError(field, f"must be positive, got {value!r}")
    return result


@dataclass(frozen=True)
class ModelSource:
    """Where the model comes from: `kind` is "hf", "pvc" or "path"."""

    kind: str
    location: str  # hf repo id, PVC claim name, or absolute path
    revision: str | None = None
    sub_path: str = ""  # path inside the PVC


def parse_uri(uri: str) -> ModelSource:
    if uri.startswith("hf://"):
        # hf://org/name[@revision][/FILE.gguf]: the GGUF file is for the fetch step (it gets the
        # whole URI); the repo and revision name the model.
        repo, _, revision = uri[len("hf://"):].partition("@")
        if revision.endswith(".gguf") and "/" in revision:
            revision = revision.partition("/")[0]
        repo = "/".join(repo.split("/")[:2])
        return ModelSource("hf", repo, revision or None)
    if uri.startswith("pvc://"):
        claim, _, sub = uri[len("pvc://"):].partition("/")
        return ModelSource("pvc", claim, None, sub.strip("/"))
    if uri.startswith("file://"):
        return ModelSource("path", uri[len("file://"):])
    return ModelSource("path", uri)


@dataclass(frozen=True)
class ModelSpec:
    uri: str
    source: ModelSource
    served_name: str
    config: Mapping[str, Any] | None = None  # inline HF config: gives the shape without the files
    hf_token_secret: tuple[str, str] | None = None  # (secret name, key)
    size_limit: int | None = None  # bytes; the models emptyDir's sizeLimit (None: derived, manifests.py)


KV_OFFLOAD_MEDIA = ("memory", "emptyDir", "pvc")
KV_OFFLOAD_ACCESS_MODES = ("ReadWriteMany", "ReadWriteOnce", "ReadWriteOncePod")


@dataclass(frozen=True)
class KVOffloadSpec:
    """spec.runtime.kvOffload: the runtime's KV offload tier (--kv-offload-bytes/-dir, per rank)."""

    size_bytes: int  # per tensor-parallel rank, as the runtime's --kv-offload-bytes
    medium: str = "emptyDir"  # memory: host RAM; emptyDir: files on the node; pvc: files on a claim
    claim_name: str | None = None  # medium pvc: an existing PersistentVolumeClaim
    # medium pvc without claimName: the operator creates the claim in this StorageClass
    storage_class_name: str | None = None
    claim_size: int | None = None  # bytes of the created claim (None: kvcache.default_claim_bytes)
    access_mode: str = "ReadWriteMany"  # of the created claim


@dataclass(frozen=True)
class RuntimeSpec:
    engine: str = "kvserve"
    image: str = DEFAULT_IMAGE
    agent_image: str = DEFAULT_IMAGE
    image_pull_policy: str = "IfNotPresent"
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    max_model_len: int | None = None
    dtype: str = "auto"
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_num_seqs: int | None = None
    gpu_memory_utilization: float = 0.9
    drain_timeout_seconds: int = 120
    resources: Mapping[str, Any] = field(default_factory=dict)
    api_key_secret: tuple[str, str] | None = None  # (secret name, key): the user API key
    admin_api_key_secret: tuple[str, str] | None = None  # None: a random per-pod admin token
    kv_offload: KVOffloadSpec | None = None


@dataclass(frozen=True)
class GPUSpec:
    resource_name: str = "nvidia.com/gpu"
    per_shard: int = 1
    memory: str = "80Gi"
    memory_bytes: int = 80 * 1024**3
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Mapping[str, Any] | None = None
    priority_class_name: str | None = None
    gpus_per_node: int | None = None  # None: a replica always fits one node (a Deployment)


@dataclass(frozen=True)
class TensorSpec:
    min: int = 1
    max: int = 1
    initial: int = 1


@dataclass(frozen=True)
class TensorAutoscaling:
    enabled: bool = False
    scale_down_window_seconds: float = 900.0
    kv_saturation: float = 0.9
    few_running_requests: float = 2.0


@dataclass(frozen=True)
class LayoutAutoscaling:
    """With parallelism.devicesPerPod: when each pod's DP x TP layout changes in place."""

    enabled: bool = True
    high_load_requests: float = 8.0  # per pod, running + waiting: the most data-parallel layout
    low_load_requests: float = 2.0  # per pod: the highest tensor-parallel layout
    stabilization_seconds: float = 30.0
    reshape_cost_multiple: float = 20.0
    # > 0: the highest TP only while the measured TPOT misses this (seconds per output token);
    # 0: low load alone asks for it.
    tpot_slo_seconds: float = 0.0


@dataclass(frozen=True)
class AutoscalingSpec:
    enabled: bool = True
    min_replicas: int = 1
    max_replicas: int = 4
    target_kv_utilization: float = 0.7
    target_queue_depth: float = 4.0
    tolerance: float = 0.1
    scale_up_window_seconds: float = 30.0
    scale_down_window_seconds: float = 300.0
    max_scale_up_step: int = 4
    max_scale_down_step: int = 2
    panic_threshold: float = 2.0
    panic_window_seconds: float = 60.0
    scale_to_zero_after_seconds: float = 300.0  # with min_replicas 0: idle this long, then 0 replicas
    tensor: TensorAutoscaling = field(default_factory=TensorAutoscaling)
    layout: LayoutAutoscaling = field(default_factory=LayoutAutoscaling)


@dataclass(frozen=True)
class RouterSpec:
    """`kvserve router` in front of the pods (cache-aware routing, holds requests at zero)."""

    enabled: bool = False
    replicas: int = 1
    policy: str = "prefix"
    hold_timeout_seconds: int = 300
    # With the prefix policy: the pods publish KV events and the router ranks them by the blocks
    # they hold (docs/kv-events.md).
    kv_events: bool = True

    @property
    def follows_kv_events(self) -> bool:
        return self.enabled and self.policy == "prefix" and self.kv_events


@dataclass(frozen=True)
class NetworkPolicySpec:
    """Who may open connections to the service's pods (operator/netpol.py renders it)."""

    enabled: bool = True
    allow_same_namespace: bool = True  # every pod of the service's namespace may call it
    allowed_namespaces: tuple[str, ...] = ()  # every pod of these namespaces may call it
    allowed_pods: tuple[Mapping[str, Any], ...] = ()  # label selectors of pods in its namespace
    metrics_namespaces: tuple[str, ...] = ("monitoring",)  # Prometheus: scrapes every port
    metrics_pod_selector: Mapping[str, Any] = field(default_factory=dict)  # {}: any pod there


@dataclass(frozen=True)
class AdapterSpec:
    """One LoRA adapter (spec.adapters[]): clients pick it by `name` in `model`."""

    name: str
    uri: str


@dataclass(frozen=True)
class LoraSpec:
    """spec.lora: whether the runtime runs with LoRA, and its limits (vLLM's flags)."""

    enabled: bool = False  # effective: spec.lora.enabled, else whether spec.adapters lists any
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int = 16


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's accepted --max-lora-rank values
MAX_ADAPTERS = 256
DEFAULT_MAX_CPU_LORAS = 16
_ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_ADAPTER_URI = re.compile(r"^(hf://[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?|file:///.+|/.+)$")


@dataclass(frozen=True)
class ServiceSpec:
    model: ModelSpec
    runtime: RuntimeSpec
    gpu: GPUSpec
    tensor: TensorSpec
    autoscaling: AutoscalingSpec
    replicas: int | None = None  # manual size; only without autoscaling
    router: RouterSpec = field(default_factory=RouterSpec)
    network_policy: NetworkPolicySpec = field(default_factory=NetworkPolicySpec)
    pipeline: int = 1  # pipeline stages per replica (spec.parallelism.pipeline)
    rendezvous_key_secret: tuple[str, str] | None = None  # (secret, key) for multi-node ranks
    adapters: tuple[AdapterSpec, ...] = ()
    lora: LoraSpec = field(default_factory=LoraSpec)
    # G: devices per pod, served as a DP x TP layout the operator changes in place (None: off).
    devices_per_pod: int | None = None

    @property
    def gpus_per_replica_per_tp(self) -> int:
        return self.gpu.per_shard


class _Reader:
    """Typed access to one mapping of the spec, naming the field in every error."""

    def __init__(self, raw: Any, path: str):
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise SpecError(path, f"must be an object, got {type(raw).__name__}")
        self.raw, self.path = raw, path

    def name(self, key: str) -> str:
        return f"{self.path}.{key}"

    def sub(self, key: str) -> _Reader:
        return _Reader(self.raw.get(key), self.name(key))

    def string(self, key: str, default: str | None = None, *, choices: tuple[str, ...] = (),
               required: bool = False) -> str | None:
        value = self.raw.get(key, default)
        if value is None:
            if required:
                raise SpecError(self.name(key), "is required")
            return None
        if not isinstance(value, str) or (required and not value):
            raise SpecError(self.name(key), f"must be a non-empty string, got {value!r}")
        if choices and value not in choices:
            raise SpecError(self.name(key), f"unsupported value {value!r}; supported: {', '.join(choices)}")
        return value

    def boolean(self, key: str, default: bool) -> bool:
        value = self.raw.get(key, default)
        if not isinstance(value, bool):
            raise SpecError(self.name(key), f"must be true or false, got {value!r}")
        return value

    def integer(self, key: str, default: int | None, *, lo: int | None = None, hi: int | None = None,
                choices: tuple[int, ...] = ()) -> int | None:
        value = self.raw.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(self.name(key), f"must be an integer, got {value!r}")
        _bounds(self.name(key), value, lo, hi)
        if choices and value not in choices:
            raise SpecError(self.name(key), f"must be one of {list(choices)}, got {value}")
        return value

    def number(self, key: str, default: float, *, lo: float | None = None, hi: float | None = None,
               lo_exclusive: bool = False) -> float:
        value = self.raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecError(self.name(key), f"must be a number, got {value!r}")
        if lo_exclusive and lo is not None and value <= lo:
            raise SpecError(self.name(key), f"must be > {lo}, got {value}")
        _bounds(self.name(key), value, None if lo_exclusive else lo, hi)
        return float(value)

    def mapping(self, key: str) -> Mapping[str, Any] | None:
        value = self.raw.get(key)
        if value is not None and not isinstance(value, Mapping):
            raise SpecError(self.name(key), f"must be an object, got {type(value).__name__}")
        return value

    def array(self, key: str) -> list:
        value = self.raw.get(key) or []
        if not isinstance(value, list):
            raise SpecError(self.name(key), f"must be a list, got {type(value).__name__}")
        return value


def _secret_ref(parent: _Reader, key: str, default_key: str) -> tuple[str, str] | None:
    """A `{name, key}` Secret reference, or None when the field is absent."""
    if parent.mapping(key) is None:
        return None
    ref = parent.sub(key)
    name = ref.string("name", required=True)
    if len(name) > 253 or not _SUBDOMAIN.match(name):
        raise SpecError(ref.name("name"), f"must be a Secret name (a DNS subdomain), got {name!r}")
    secret_key = ref.string("key", default_key)
    if len(secret_key) > 253 or not _SECRET_KEY.match(secret_key):
        raise SpecError(ref.name("key"), f"must be a Secret data key (letters, digits, '-', '_', '.'), "
                        f"got {secret_key!r}")
    return name, secret_key


def checkpoint_size_limit(config: Mapping[str, Any] | None) -> int | None:
    """A size limit for the model's files, from its inline config: the full-precision weights in
    the config's dtype (a quantized checkpoint is smaller), a quarter more and 1 GiB for the
    tokenizer and other files, rounded up to GiB. Only the spec's own config counts: a config the
    pods report later must not change the pod template (that would roll every pod)."""
    if config is None:
        return None
    try:
        shape = ModelShape.from_hf_config(config)
    except (ValueError, TypeError, KeyError):
        return None  # model_shape() reports the bad config with its field
    dtype = config.get("torch_dtype") or config.get("dtype")
    weights = weight_bytes_per_gpu(shape, 2 if dtype in ("bfloat16", "float16") else 4)
    return _round_up_gib(weights * 1.25 + GIB)


def _round_up_gib(size: float) -> int:
    return -(-int(size) // GIB) * GIB


def _label_selector(raw: Any, path: str) -> Mapping[str, Any]:
    """A Kubernetes label selector (matchLabels / matchExpressions), checked enough that the
    NetworkPolicy made from it is one the API server accepts."""
    sel = _Reader(raw, path)
    unknown = set(sel.raw) - {"matchLabels", "matchExpressions"}
    if unknown:
        raise SpecError(sel.name(sorted(unknown)[0]), "unknown field; a label selector has matchLabels "
                        "and matchExpressions")
    for key, value in (sel.mapping("matchLabels") or {}).items():
        if not isinstance(value, str):
            raise SpecError(f"{path}.matchLabels.{key}", f"must be a string, got {value!r}")
    for i, item in enumerate(sel.array("matchExpressions")):
        e = _Reader(item, f"{path}.matchExpressions[{i}]")
        e.string("key", required=True)
        e.string("operator", required=True, choices=("In", "NotIn", "Exists", "DoesNotExist"))
        if not all(isinstance(v, str) for v in e.array("values")):
            raise SpecError(e.name("values"), "must be a list of strings")
    return dict(sel.raw)


def _namespace_names(reader: _Reader, key: str, default: tuple[str, ...]) -> tuple[str, ...]:
    if key not in reader.raw:
        return default
    names = reader.array(key)
    for i, ns in enumerate(names):
        if not isinstance(ns, str) or len(ns) > 63 or not _NAME.match(ns):
            raise SpecError(f"{reader.name(key)}[{i}]", f"must be a namespace name, got {ns!r}")
    return tuple(names)


def parse_network_policy(raw: Any) -> NetworkPolicySpec:
    n = _Reader(raw, "spec.networkPolicy")
    metrics = n.sub("metrics")
    return NetworkPolicySpec(
        enabled=n.boolean("enabled", True),
        allow_same_namespace=n.boolean("allowSameNamespace", True),
        allowed_namespaces=_namespace_names(n, "allowedNamespaces", ()),
        allowed_pods=tuple(_label_selector(s, f"spec.networkPolicy.allowedPods[{i}]")
                           for i, s in enumerate(n.array("allowedPods"))),
        metrics_namespaces=_namespace_names(metrics, "namespaces", ("monitoring",)),
        metrics_pod_selector=_label_selector(metrics.mapping("podSelector") or {},
                                             "spec.networkPolicy.metrics.podSelector"),
    )


def _refuse_plain_credentials(env: list[tuple[str, str]], args: list[str]) -> None:
    for i, (name, _) in enumerate(env):
        if name in SECRET_ENV:
            raise SpecError(f"spec.runtime.env[{i}]", f"{name} must not be given in plain text (anyone who "
                            f"can read this InferenceService or its Deployment would read it); put it in a "
                            f"Secret and reference it with {SECRET_ENV[name]}: {{name, key}}")
    for i, arg in enumerate(args):
        flag = arg.split("=", 1)[0]
        if flag in SECRET_ARGS:
            raise SpecError(f"spec.runtime.args[{i}]", f"{flag} must not be given in plain text; put the key "
                            f"in a Secret and reference it with {SECRET_ARGS[flag]}: {{name, key}}")


def _bounds(name: str, value: float, lo: float | None, hi: float | None) -> None:
    if lo is not None and value < lo:
        raise SpecError(name, f"must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise SpecError(name, f"must be <= {hi}, got {value}")


def default_served_name(source: ModelSource) -> str:
    if source.kind == "hf":
        return source.location
    tail = (source.sub_path or source.location).rstrip("/").rsplit("/", 1)[-1]
    return tail or "model"


def parse_spec(raw: Mapping[str, Any]) -> ServiceSpec:
    """Parses and validates `spec`; raises SpecError (a ValueError) naming the first bad field."""
    top = _Reader(raw, "spec")

    m = top.sub("model")
    uri = m.string("uri", required=True)
    if not _URI.match(uri):
        raise SpecError("spec.model.uri", f"must be hf://org/name[@revision][/FILE.gguf], pvc://claim[/path], "
                        f"file:///path or /path, got {uri!r}")
    source = parse_uri(uri)
    config = m.mapping("config")
    size_limit = m.raw.get("sizeLimit")
    size_limit = (parse_quantity(size_limit, "spec.model.sizeLimit") if size_limit is not None
                  else checkpoint_size_limit(config))
    model = ModelSpec(uri=uri, source=source,
                      served_name=m.string("servedName") or default_served_name(source),
                      config=config, hf_token_secret=_secret_ref(m, "hfTokenSecret", "HF_TOKEN"),
                      size_limit=size_limit)

    r = top.sub("runtime")
    image = r.string("image", DEFAULT_IMAGE)
    env = []
    for i, item in enumerate(r.array("env")):
        e = _Reader(item, f"spec.runtime.env[{i}]")
        env.append((e.string("name", required=True), e.string("value", "")))
    args = r.array("args")
    for i, arg in enumerate(args):
        if not isinstance(arg, str):
            raise SpecError(f"spec.runtime.args[{i}]", f"must be a string, got {arg!r}")
    _refuse_plain_credentials(env, args)
    runtime = RuntimeSpec(
        engine=r.string("engine", "kvserve", choices=ENGINES),
        image=image,
        agent_image=r.string("agentImage", DEFAULT_IMAGE),
        image_pull_policy=r.string("imagePullPolicy", "IfNotPresent", choices=PULL_POLICIES),
        args=tuple(args),
        env=tuple(env),
        max_model_len=r.integer("maxModelLen", None, lo=16, hi=10_000_000),
        dtype=r.string("dtype", "auto", choices=DTYPES),
        quantization=r.string("quantization", None, choices=QUANTIZATIONS),
        kv_cache_dtype=r.string("kvCacheDtype", "auto", choices=KV_CACHE_DTYPES),
        block_size=r.integer("blockSize", 16, choices=BLOCK_SIZES),
        enable_prefix_caching=r.boolean("enablePrefixCaching", True),
        max_num_seqs=r.integer("maxNumSeqs", None, lo=1, hi=65536),
        gpu_memory_utilization=r.number("gpuMemoryUtilization", 0.9, lo=0.05, hi=1.0),
        drain_timeout_seconds=r.integer("drainTimeoutSeconds", 120, lo=0, hi=3600),
        resources=r.mapping("resources") or {},
        api_key_secret=_secret_ref(r, "apiKeySecret", "KVSERVE_API_KEY"),
        admin_api_key_secret=_secret_ref(r, "adminApiKeySecret", "KVSERVE_ADMIN_API_KEY"),
        kv_offload=parse_kv_offload(r),
    )

    if runtime.engine == "vllm" and runtime.quantization in ("int8", "int4"):
        raise SpecError("spec.runtime.quantization", f"{runtime.quantization!r} is kvserve's load-time "
                        f"quantization; vLLM has no such method (use engine: kvserve, or a checkpoint quantized "
                        f"as awq, gptq, compressed-tensors or fp8)")

    g = top.sub("gpu")
    memory = g.raw.get("memory", "80Gi")
    node_selector = g.mapping("nodeSelector") or {}
    for key, value in node_selector.items():
        if not isinstance(value, str):
            raise SpecError(f"spec.gpu.nodeSelector.{key}", f"must be a string, got {value!r}")
    gpu = GPUSpec(
        resource_name=g.string("resourceName", "nvidia.com/gpu"),
        per_shard=g.integer("perShard", 1, lo=0, hi=16),
        memory=str(memory),
        memory_bytes=parse_quantity(memory, "spec.gpu.memory"),
        node_selector=node_selector,
        tolerations=tuple(g.array("tolerations")),
        affinity=g.mapping("affinity"),
        priority_class_name=g.string("priorityClassName"),
        gpus_per_node=g.integer("gpusPerNode", None, lo=1, hi=64),
    )

    t = top.sub("parallelism").sub("tensor")
    tensor = TensorSpec(
        min=t.integer("min", 1, lo=1, hi=64),
        max=t.integer("max", 1, lo=1, hi=64),
        initial=t.integer("initial", None, lo=1, hi=64) or t.integer("min", 1),
    )
    for key in ("min", "max", "initial"):
        if getattr(tensor, key) not in TP_DEGREES:
            raise SpecError(t.name(key), f"must be a power of two, got {getattr(tensor, key)}")
    if not tensor.min <= tensor.initial <= tensor.max:
        raise SpecError(t.path, f"needs min <= initial <= max, got {tensor.min}, {tensor.initial}, {tensor.max}")

    a = top.sub("autoscaling")
    ta = a.sub("tensorParallel")
    la = a.sub("layout")
    autoscaling = AutoscalingSpec(
        enabled=a.boolean("enabled", True),
        min_replicas=a.integer("minReplicas", 1, lo=0, hi=1000),
        max_replicas=a.integer("maxReplicas", 4, lo=1, hi=1000),
        target_kv_utilization=a.number("targetKVCacheUtilization", 0.7, lo=0.05, hi=1.0),
        target_queue_depth=a.number("targetQueueDepth", 4.0, lo=0.0, hi=10000, lo_exclusive=True),
        tolerance=a.number("tolerance", 0.1, lo=0.0, hi=0.5),
        scale_up_window_seconds=a.number("scaleUpStabilizationSeconds", 30, lo=0, hi=3600),
        scale_down_window_seconds=a.number("scaleDownStabilizationSeconds", 300, lo=0, hi=3600),
        max_scale_up_step=a.integer("maxScaleUpStep", 4, lo=1, hi=1000),
        max_scale_down_step=a.integer("maxScaleDownStep", 2, lo=1, hi=1000),
        panic_threshold=a.number("panicThreshold", 2.0, lo=1.1, hi=100),
        panic_window_seconds=a.number("panicWindowSeconds", 60, lo=0, hi=3600),
        scale_to_zero_after_seconds=a.number("scaleToZeroAfterSeconds", 300, lo=0, hi=86400),
        tensor=TensorAutoscaling(
            enabled=ta.boolean("enabled", False),
            scale_down_window_seconds=ta.number("scaleDownStabilizationSeconds", 900, lo=0, hi=86400),
            kv_saturation=ta.number("kvSaturation", 0.9, lo=0.1, hi=1.0),
            few_running_requests=ta.number("fewRunningRequests", 2, lo=0, hi=10000),
        ),
        layout=LayoutAutoscaling(
            enabled=la.boolean("enabled", True),
            high_load_requests=la.number("highLoadRequests", 8, lo=0, hi=10000),
            low_load_requests=la.number("lowLoadRequests", 2, lo=0, hi=10000),
            stabilization_seconds=la.number("stabilizationSeconds", 30, lo=0, hi=86400),
            reshape_cost_multiple=la.number("reshapeCostMultiple", 20, lo=0, hi=10000),
            tpot_slo_seconds=la.number("tpotSloSeconds", 0, lo=0, hi=3600),
        ),
    )
    if autoscaling.layout.low_load_requests > autoscaling.layout.high_load_requests:
        raise SpecError("spec.autoscaling.layout", "needs lowLoadRequests <= highLoadRequests")
    if autoscaling.min_replicas > autoscaling.max_replicas:
        raise SpecError("spec.autoscaling", f"needs minReplicas <= maxReplicas, got "
                        f"{autoscaling.min_replicas} > {autoscaling.max_replicas}")
    replicas = top.integer("replicas", None, lo=0, hi=1000)
    if replicas is not None and autoscaling.enabled:
        raise SpecError("spec.replicas", "may only be set when spec.autoscaling.enabled is false")
    rt = top.sub("router")
    router = RouterSpec(
        enabled=rt.boolean("enabled", False),
        replicas=rt.integer("replicas", 1, lo=1, hi=100),
        policy=rt.string("policy", "prefix", choices=ROUTER_POLICIES),
        hold_timeout_seconds=rt.integer("holdTimeoutSeconds", 300, lo=1, hi=3600),
        kv_events=rt.boolean("kvEvents", True),
    )
    if autoscaling.enabled and autoscaling.min_replicas == 0 and not router.enabled:
        # Without the router nothing would hold the requests that arrive while no pod runs, and
        # nothing would tell the operator to wake the service: they would just fail.
        raise SpecError("spec.autoscaling.minReplicas", "0 (scale to zero) needs spec.router.enabled: true "
                        "(the router holds requests while no pod runs and wakes the service)")
    p = top.sub("parallelism")
    devices = p.integer("devicesPerPod", None, lo=1, hi=64)
    if devices is not None:
        if devices not in TP_DEGREES:
            raise SpecError(p.name("devicesPerPod"), f"must be a power of two, got {devices}")
        if tensor.max > devices:
            raise SpecError(p.name("devicesPerPod"), f"{devices} devices cannot hold parallelism.tensor.max "
                            f"{tensor.max} ranks")
        if runtime.engine != "kvserve":
            raise SpecError(p.name("devicesPerPod"), "changes layouts in place through kvserve's "
                            "/admin/parallelism: needs runtime.engine kvserve")
        if runtime.admin_api_key_secret is None:
            raise SpecError(p.name("devicesPerPod"), "the operator calls the pods' admin route to change "
                            "their layout: set runtime.adminApiKeySecret (a Secret the operator may read)")
    adapters, lora = parse_adapters(top, model.served_name)
    spec = ServiceSpec(model=model, runtime=runtime, gpu=gpu, tensor=tensor,
                       autoscaling=autoscaling, replicas=replicas, router=router,
                       network_policy=parse_network_policy(top.raw.get("networkPolicy")),
                       devices_per_pod=devices, adapters=adapters, lora=lora,
                       pipeline=p.integer("pipeline", 1, lo=1, hi=64),
                       rendezvous_key_secret=_secret_ref(p, "rendezvousKeySecret", "key"))
    from .multinode import check_multinode

    check_multinode(spec)
    return spec


def parse_kv_offload(runtime: _Reader) -> KVOffloadSpec | None:
    if runtime.raw.get("kvOffload") is None:
        return None
    k = runtime.sub("kvOffload")
    if k.raw.get("size") is None:
        raise SpecError(k.name("size"), "is required (the tier's bytes per tensor-parallel rank, e.g. 8Gi)")
    size = parse_quantity(k.raw["size"], k.name("size"))
    if size < 1024**2:
        raise SpecError(k.name("size"), f"must be at least 1Mi, got {k.raw['size']!r}")
    medium = k.string("medium", "emptyDir", choices=KV_OFFLOAD_MEDIA)
    claim = k.string("claimName")
    storage_class = k.string("storageClassName")
    claim_size = None if k.raw.get("claimSize") is None else parse_quantity(k.raw["claimSize"], k.name("claimSize"))
    access_mode = k.string("accessMode", "ReadWriteMany", choices=KV_OFFLOAD_ACCESS_MODES)
    if medium == "pvc":
        if claim is not None and storage_class is not None:
            raise SpecError(k.name("storageClassName"), "give claimName (an existing claim) or storageClassName "
                            "(the operator creates one), not both")
        if storage_class is None and (not claim or not _NAME.match(claim)):
            raise SpecError(k.name("claimName"), f"medium pvc needs the name of an existing PersistentVolumeClaim "
                            f"(or storageClassName, to have the operator create one), got {claim!r}")
        if storage_class is not None and not _SUBDOMAIN.match(storage_class):
            raise SpecError(k.name("storageClassName"), f"must be a StorageClass name, got {storage_class!r}")
    else:
        for field_name, value in (("claimName", claim), ("storageClassName", storage_class)):
            if value is not None:
                raise SpecError(k.name(field_name), f"only with medium pvc, not {medium!r}")
    if storage_class is None:
        for field_name in ("claimSize", "accessMode"):
            if k.raw.get(field_name) is not None:
                raise SpecError(k.name(field_name), "only with storageClassName (a claim the operator creates)")
    if claim_size is not None and claim_size < size:
        raise SpecError(k.name("claimSize"), f"must hold at least the tier's size ({k.raw['size']!r}), "
                        f"got {k.raw['claimSize']!r}")
    if runtime.raw.get("engine", "kvserve") != "kvserve":
        raise SpecError(k.path, "is kvserve's offload tier (--kv-offload-bytes); needs runtime.engine kvserve")
    return KVOffloadSpec(size, medium, claim, storage_class, claim_size, access_mode)


def parse_adapters(top: _Reader, served_name: str) -> tuple[tuple[AdapterSpec, ...], LoraSpec]:
    """spec.adapters and spec.lora (docs/lora.md)."""
    items = top.array("adapters")
    if len(items) > MAX_ADAPTERS:
        raise SpecError("spec.adapters", f"{len(items)} adapters, at most {MAX_ADAPTERS}")
    adapters: list[AdapterSpec] = []
    for i, item in enumerate(items):
        a = _Reader(item, f"spec.adapters[{i}]")
        name, uri = a.string("name", required=True), a.string("uri", required=True)
        if not _ADAPTER_NAME.match(name):
            raise SpecError(a.name("name"), f"must be letters, digits, '.', '_' or '-' (at most 128), got {name!r}")
        if name == served_name:
            raise SpecError(a.name("name"), f"{name!r} is the model's served name; clients pick an adapter by "
                            "its own name")
        if name in {x.name for x in adapters}:
            raise SpecError(a.name("name"), f"{name!r} is listed twice")
        if len(uri) > 1024 or not _ADAPTER_URI.match(uri):
            raise SpecError(a.name("uri"), f"must be hf://org/name[@revision], file:///path or /path, got {uri!r}")
        adapters.append(AdapterSpec(name, uri))
    lo = top.sub("lora")
    enabled = lo.raw.get("enabled")
    if enabled is not None and not isinstance(enabled, bool):
        raise SpecError(lo.name("enabled"), f"must be true or false, got {enabled!r}")
    max_loras = lo.integer("maxLoras", 4, lo=1, hi=64)
    # The default does not follow the number of adapters: the runtime's flags are in the pod
    # template, and adding an adapter must not restart the pods.
    cpu = lo.integer("maxCpuLoras", max(max_loras, DEFAULT_MAX_CPU_LORAS), lo=1, hi=MAX_ADAPTERS)
    if cpu < max_loras:
        raise SpecError(lo.name("maxCpuLoras"), f"must be at least spec.lora.maxLoras ({max_loras}), got {cpu}")
    if len(adapters) > cpu:
        raise SpecError("spec.adapters", f"{len(adapters)} adapters, more than spec.lora.maxCpuLoras ({cpu}) "
                        "lets a pod hold")
    lora = LoraSpec(enabled=bool(adapters) if enabled is None else enabled, max_loras=max_loras,
                    max_lora_rank=lo.integer("maxLoraRank", 16, choices=LORA_RANKS), max_cpu_loras=cpu)
    if adapters and not lora.enabled:
        raise SpecError(lo.name("enabled"), "is false but spec.adapters lists adapters")
    return tuple(adapters), lora


def model_shape(spec: ServiceSpec, read_config=None) -> ModelShape | None:
    """The model's shape from the inline config, or from `read_config(path)` for local paths.

    `read_config` is the shell's file reader (None in pure contexts); a model whose config is
    neither inline nor readable gives None: the operator then keeps TP fixed.
    """
    config = spec.model.config
    if config is None and read_config is not None and spec.model.source.kind == "path":
        config = read_config(spec.model.source.location)
    if config is None:
        return None
    try:
        return ModelShape.from_hf_config(config)
    except (ValueError, TypeError) as error:
        raise SpecError("spec.model.config", str(error).removeprefix("model config: ")) from None


def shape_unknown_message(spec: ServiceSpec) -> str:
    """What to do when the model's shape is unknown (TP cannot be planned), for status and plan."""
    where = ("an hf:// model is only read from the operator's local Hugging Face cache"
             if spec.model.source.kind == "hf" else "the operator cannot read the model's config.json")
    return (f"TP planning needs the model's shape: it is learned from the pods' agents once a pod has "
            f"fetched the model (status.model), or set spec.model.config (the model's config.json fields) "
            f"or use a local model path ({where}); TP stays at {spec.tensor.initial} until then")


def check_servable(spec: ServiceSpec, shape: ModelShape | None) -> None:
    """Rules the schema cannot express: TP degrees must shard this model's heads."""
    if shape is None:
        return
    # min/max only bound the search (valid_tp_degrees skips degrees the heads rule out); the
    # degree that would actually run must itself be valid.
    error = shape.tp_error(spec.tensor.initial)
    if error:
        raise SpecError("spec.parallelism.tensor.initial", error)
    from kvserve.runtime.capacity.pipeline import pipeline_error

    error = pipeline_error(shape, spec.pipeline)
    if error:
        raise SpecError("spec.parallelism.pipeline", error.removeprefix("pipeline_parallel_size: "))


def dtype_for_capacity(spec: ServiceSpec) -> str:
    """The dtype to plan KV with: "auto" follows the model config, else bfloat16."""
    if spec.runtime.dtype != "auto":
        return spec.runtime.dtype
    config_dtype = (spec.model.config or {}).get("torch_dtype") or (spec.model.config or {}).get("dtype")
    return config_dtype if config_dtype in DTYPES[1:] else "bfloat16"


def weight_format_for_capacity(spec: ServiceSpec, dtype_size: int) -> WeightFormat | None:
    """The weight format to plan with: spec.runtime.quantization, else the inline config's own
    quantization_config (an AWQ checkpoint is AWQ whatever the spec says), else full precision."""
    config = spec.model.config or {}
    qc = config.get("quantization_config") if isinstance(config.get("quantization_config"), Mapping) else None
    name = spec.runtime.quantization
    if name is None and qc is not None:
        name = checkpoint_format(config) or None
        if name not in WEIGHT_FORMATS:
            return None  # the runtime refuses it; plan as full precision meanwhile
    if name is None:
        return None
    hidden = int(config.get("hidden_size") or 4096)
    try:
        return weight_format(name, dtype_size, hidden, qc)
    except ValueError:
        return None  # a quantization_config the runtime refuses; plan as full precision meanwhile


def kv_dtype_size_for_capacity(spec: ServiceSpec) -> int | None:
    """Bytes per KV element when the KV cache dtype differs from the model's (FP8: 1)."""
    return 1 if spec.runtime.kv_cache_dtype.startswith("fp8") else None


def check_name(name: str) -> None:
    if not _NAME.match(name or "") or len(name) > 52:
        # Owned objects take the resource's name; 52 leaves room for ReplicaSet/Pod suffixes.
        raise SpecError("metadata.name", f"must be a DNS label of at most 52 characters, got {name!r}")
