"""The CRD as data: load it, default an object the way the API server does, and validate it.

Validation mirrors what an API server does on create: the structural OpenAPI schema (jsonschema,
draft 4 semantics as OpenAPI 3.0 uses), unknown fields rejected as with kubectl's strict field
validation, and the CEL `x-kubernetes-validations` rules evaluated with `cel-python` when it is
installed. `plan` and the tests use it; the operator itself re-checks specs in `spec.py`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

CRD_FILE = "inferenceservices.kvserve.dev.yaml"


def crd_path() -> Path:
    for candidate in (Path(__file__).resolve().parents[1] / "crds" / CRD_FILE, Path(__file__).with_name(CRD_FILE)):
        if candidate.exists():
            return candidate
    raise FileNotFoundError(f"{CRD_FILE} not found next to the kvserve operator")


def load_crd() -> dict[str, Any]:
    return yaml.safe_load(crd_path().read_text())


def openapi_schema(crd: Mapping[str, Any] | None = None, version: str = "v1alpha1") -> dict[str, Any]:
    crd = crd or load_crd()
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            return v["schema"]["openAPIV3Schema"]
    raise KeyError(version)


def apply_defaults(obj: Any, schema: Mapping[str, Any]) -> Any:
    """A copy of `obj` with the schema's defaults filled in, recursively (as the API server does)."""
    obj = copy.deepcopy(obj)
    _default(obj, schema)
    return obj


def _default(obj: Any, schema: Mapping[str, Any]) -> None:
    if isinstance(obj, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key not in obj and "default" in sub:
                obj[key] = copy.deepcopy(sub["default"])
            if key in obj:
                _default(obj[key], sub)
        extra = schema.get("additionalProperties")
        if isinstance(extra, Mapping):
            for key in obj:
                if key not in (schema.get("properties") or {}):
                    _default(obj[key], extra)
    elif isinstance(obj, list) and isinstance(schema.get("items"), Mapping):
        for item in obj:
            _default(item, schema["items"])


def _strict(schema: Any) -> Any:
    """Objects with declared properties reject unknown ones (kubectl's strict field validation)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if (out.get("type") == "object" and "properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def _rules(obj: Any, schema: Mapping[str, Any], path: str) -> Iterator[tuple[str, Mapping[str, Any], Any]]:
    for rule in schema.get("x-kubernetes-validations") or ():
        yield path, rule, obj
    if isinstance(obj, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key in obj:
                yield from _rules(obj[key], sub, f"{path}.{key}")
    elif isinstance(obj, list) and isinstance(schema.get("items"), Mapping):
        for i, item in enumerate(obj):
            yield from _rules(item, schema["items"], f"{path}[{i}]")


def cel_available() -> bool:
    try:
        import celpy  # noqa: F401
    except ImportError:
        return False
    return True


def validate(obj: Mapping[str, Any], *, cel: bool = True, crd: Mapping[str, Any] | None = None,
             version: str = "v1alpha1") -> list[str]:
    """Errors an API server would answer for `obj` (after defaulting); [] when it is accepted.

    `crd`/`version`: another CRD's schema (tests check other projects' custom resources too)."""
    import jsonschema

    schema = openapi_schema(crd, version)
    defaulted = apply_defaults(obj, schema)
    validator = jsonschema.Draft4Validator(_strict(schema))
    errors = [f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
              for e in validator.iter_errors(defaulted)]
    if errors or not cel or not cel_available():
        return errors
    import celpy

    env = celpy.Environment()
    for path, rule, value in _rules(defaulted, schema, "<root>"):
        program = env.program(env.compile(rule["rule"]))
        try:
            ok = program.evaluate({"self": celpy.json_to_cel(value)})
        except celpy.CELEvalError as error:  # a missing field the rule did not guard
            ok = False
            rule = {**rule, "message": f"{rule.get('message', rule['rule'])} ({error})"}
        if not bool(ok) or isinstance(ok, celpy.CELEvalError):
            errors.append(f"{path}: {rule.get('message', rule['rule'])}")
    return errors
