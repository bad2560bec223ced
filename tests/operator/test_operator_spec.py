"""The CRD's schema and CEL rules, and the operator's own spec parser, agree and reject bad input."""

from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from kvserve.operator import crd
from kvserve.operator.spec import SpecError, check_servable, model_shape, parse_quantity, parse_spec

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "crds" / "examples").glob("*.yaml"))


def example(name: str) -> dict:
    return yaml.safe_load((EXAMPLES[0].parent / f"{name}.yaml").read_text())


def test_crd_is_a_valid_kubernetes_object():
    kubernetes_validate.validate(crd.load_crd(), "1.33.0", strict=True)


def test_cel_library_is_installed_so_rules_are_evaluated():
    assert crd.cel_available()


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_examples_pass_schema_cel_and_parser(path):
    obj = yaml.safe_load(path.read_text())
    assert crd.validate(obj) == []
    spec = parse_spec(crd.apply_defaults(obj, crd.openapi_schema())["spec"])
    check_servable(spec, model_shape(spec))


def test_parser_defaults_equal_crd_defaults():
    minimal = {"model": {"uri": "hf://org/m"}}
    defaulted = crd.apply_defaults({"spec": minimal}, crd.openapi_schema())["spec"]
    assert parse_spec(minimal) == parse_spec(defaulted)
    a = defaulted["autoscaling"]
    assert a["scaleDownStabilizationSeconds"] == 300 and a["enabled"] is True
    assert defaulted["parallelism"]["tensor"] == {"min": 1, "max": 1}


def _mutate(base: dict, path: str, value) -> dict:
    obj = copy.deepcopy(base)
    node = obj
    keys = path.split(".")
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    if value is _DELETE:
        node.pop(keys[-1], None)
    else:
        node[keys[-1]] = value
    return obj


_DELETE = object()

# (mutation path under the object, value, substring the CRD validation error must contain,
#  the field the operator's parser must name, or None when only the CRD catches it)
BAD = [
    ("spec.model.uri", "s3://bucket/model", "spec.model.uri", "spec.model.uri"),
    ("spec.model.uri", _DELETE, "uri", "spec.model.uri"),
    ("spec.runtime.engine", "sglang", "spec.runtime.engine", "spec.runtime.engine"),
    ("spec.runtime.dtype", "int4", "spec.runtime.dtype", "spec.runtime.dtype"),
    ("spec.runtime.blockSize", 12, "spec.runtime.blockSize", "spec.runtime.blockSize"),
    ("spec.runtime.gpuMemoryUtilization", 1.5, "gpuMemoryUtilization", "spec.runtime.gpuMemoryUtilization"),
    ("spec.gpu.perShard", -1, "spec.gpu.perShard", "spec.gpu.perShard"),
    ("spec.gpu.memory", "lots", None, "spec.gpu.memory"),
    ("spec.autoscaling.minReplicas", 0, "minReplicas", "spec.autoscaling.minReplicas"),
    ("spec.autoscaling.minReplicas", 9, "minReplicas <= maxReplicas", "spec.autoscaling"),
    ("spec.autoscaling.targetQueueDepth", 0, "targetQueueDepth", "spec.autoscaling.targetQueueDepth"),
    ("spec.autoscaling.targetKVCacheUtilization", "high", "targetKVCacheUtilization",
     "spec.autoscaling.targetKVCacheUtilization"),
    ("spec.parallelism.tensor", {"min": 4, "max": 2}, "min <= max", "spec.parallelism.tensor"),
    ("spec.parallelism.tensor", {"min": 1, "max": 4, "initial": 8}, "min <= initial <= max",
     "spec.parallelism.tensor"),
    ("spec.parallelism.tensor", {"min": 1, "max": 6}, "powers of two", "spec.parallelism.tensor.max"),
    ("spec.replicas", 3, "only be set when spec.autoscaling.enabled is false", "spec.replicas"),
    ("spec.runtim", {}, "runtim", None),
    ("spec.runtime.imagePullPolicy", "Sometimes", "imagePullPolicy", "spec.runtime.imagePullPolicy"),
    ("spec.router.policy", "random", "spec.router.policy", "spec.router.policy"),
    ("spec.router.replicas", 0, "spec.router.replicas", "spec.router.replicas"),
    ("spec.router.holdTimeoutSeconds", 0, "holdTimeoutSeconds", "spec.router.holdTimeoutSeconds"),
    ("spec.autoscaling.scaleToZeroAfterSeconds", -1, "scaleToZeroAfterSeconds",
     "spec.autoscaling.scaleToZeroAfterSeconds"),
]


def test_scale_to_zero_with_the_router_is_accepted():
    obj = _mutate(example("llama-8b-gpu"), "spec.autoscaling.minReplicas", 0)
    obj["spec"]["router"] = {"enabled": True, "policy": "least-load"}
    assert crd.validate(obj) == []
    spec = parse_spec(obj["spec"])
    assert spec.autoscaling.min_replicas == 0 and spec.autoscaling.scale_to_zero_after_seconds == 300
    assert (spec.router.enabled, spec.router.policy, spec.router.replicas, spec.router.hold_timeout_seconds) == \
        (True, "least-load", 1, 300)


@pytest.mark.parametrize("path,value,crd_error,field", BAD, ids=[f"{b[0]}={b[1]!r}"[:60] for b in BAD])
def test_bad_resources_fail_crd_and_parser(path, value, crd_error, field):
    obj = _mutate(example("llama-8b-gpu"), path, value)
    errors = crd.validate(obj)
    if crd_error is not None:
        assert any(crd_error in e for e in errors), errors
    if field is not None:
        with pytest.raises(SpecError) as info:
            parse_spec(obj.get("spec", {}))
        assert info.value.field == field, str(info.value)
        assert str(info.value).startswith(field)


def test_manual_mode_with_replicas_is_accepted():
    obj = example("manual-vllm")
    assert crd.validate(obj) == []
    assert parse_spec(obj["spec"]).replicas == 2


def test_tp_that_does_not_divide_heads_is_caught_by_the_operator_not_the_schema():
    obj = _mutate(example("llama-8b-gpu"), "spec.model.config.num_attention_heads", 12)
    obj["spec"]["model"]["config"]["num_key_value_heads"] = 12
    obj["spec"]["parallelism"]["tensor"] = {"min": 1, "max": 8, "initial": 8}
    assert crd.validate(obj) == []
    spec = parse_spec(obj["spec"])
    with pytest.raises(SpecError, match="spec.parallelism.tensor.initial: .*does not divide.*12 attention heads"):
        check_servable(spec, model_shape(spec))


def test_broken_inline_config_names_the_field():
    spec = parse_spec(_mutate(example("llama-8b-gpu"), "spec.model.config.hidden_size", _DELETE)["spec"])
    with pytest.raises(SpecError, match="spec.model.config: missing field 'hidden_size'"):
        model_shape(spec)


def test_config_read_from_a_local_path(tmp_path):
    config = example("llama-8b-gpu")["spec"]["model"]["config"]
    spec = parse_spec({"model": {"uri": str(tmp_path)}})
    import json

    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = model_shape(spec, lambda p: json.loads((Path(p) / "config.json").read_text()))
    assert shape.num_attention_heads == 32
    assert model_shape(spec) is None  # no reader: unknown shape, TP stays fixed


@pytest.mark.parametrize("value,expected", [("80Gi", 80 * 2**30), ("24G", 24 * 10**9), (1024, 1024),
                                            ("1.5Ti", int(1.5 * 2**40))])
def test_quantities(value, expected):
    assert parse_quantity(value, "f") == expected


def test_served_name_defaults():
    assert parse_spec({"model": {"uri": "hf://org/name@v1"}}).model.served_name == "org/name"
    assert parse_spec({"model": {"uri": "hf://org/name@v1"}}).model.source.revision == "v1"
    assert parse_spec({"model": {"uri": "pvc://models/a/b"}}).model.served_name == "b"
    assert parse_spec({"model": {"uri": "/opt/models/tiny"}}).model.served_name == "tiny"


@pytest.mark.parametrize("uri, repo, revision", [
    ("hf://bartowski/Llama-3.2-1B-Instruct-GGUF/Llama-3.2-1B-Instruct-Q4_K_M.gguf",
     "bartowski/Llama-3.2-1B-Instruct-GGUF", None),
    ("hf://org/name@main/sub/m.Q8_0.gguf", "org/name", "main"),
    ("hf://org/name@refs/pr/3", "org/name", "refs/pr/3"),
])
def test_a_gguf_file_of_a_hub_repo_is_a_model_uri(uri, repo, revision):
    """The fetch step gets the whole URI (kvserve agent fetch takes one GGUF file of a repo); the
    repo and revision name the model."""
    from kvserve.operator.manifests import build_deployment

    raw = {"model": {"uri": uri}}
    spec = parse_spec(raw)
    assert (spec.model.source.location, spec.model.source.revision) == (repo, revision)
    assert spec.model.served_name == repo
    owner = {"apiVersion": "kvserve.dev/v1alpha1", "kind": "InferenceService",
             "metadata": {"name": "m", "namespace": "ns", "uid": "0b5e2a1c-1111-4222-8333-944455556666"},
             "spec": raw}
    pod = build_deployment(owner, spec, replicas=1, tp=1)["spec"]["template"]["spec"]
    fetch = next(c for c in pod["initContainers"] + pod["containers"] if c["name"] == "fetch-model")
    assert fetch["command"][3] == uri
    with pytest.raises(SpecError, match="FILE.gguf"):
        parse_spec({"model": {"uri": "hf://org/name/weights.bin"}})


def test_the_documented_example_is_valid():
    import re

    doc = (Path(__file__).resolve().parents[2] / "docs" / "operator.md").read_text()
    block = next(b for b in re.findall(r"```yaml\n(.*?)```", doc, re.S) if "kind: InferenceService" in b)
    obj = yaml.safe_load(block)
    obj["spec"]["autoscaling"].pop("enabled")  # the reference lists replicas and autoscaling together
    obj["spec"].pop("replicas")
    assert crd.validate(obj) == []
    spec = parse_spec(obj["spec"])
    check_servable(spec, model_shape(spec))
