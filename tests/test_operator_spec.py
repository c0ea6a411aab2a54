"""One source for every bound: the operator's spec model, the process settings and the CRD agree.

The model (``agent_dispatch/operator/_spec.py``) reads the shared bounds from the settings; these
tests walk the CRD's ``spec`` schema and the model's JSON schema side by side, so a bound, a
default, an enum or a pattern changed in one place and not the other fails here.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent_dispatch import settings as s
from agent_dispatch.operator import _spec, _validate

CRD_PATH = Path(__file__).resolve().parents[1] / "crds" / "agentdispatch.yaml"
#: Keywords compared between the CRD and the model wherever either has them.
KEYWORDS = ("minimum", "maximum", "default", "enum", "pattern", "minLength", "maxLength", "maxItems")
#: A bound the CRD writes as a CEL rule (for a message naming the RTO) instead of minimum/maximum.
_CEL_BOUND = re.compile(r"^self (>=|<=) (\d+)$")


def crd_spec() -> dict[str, Any]:
    crd = yaml.safe_load(CRD_PATH.read_text())
    schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema["properties"]["spec"]


def model_spec() -> tuple[dict[str, Any], dict[str, Any]]:
    schema = _spec.DispatchSpec.model_json_schema(by_alias=True)
    return schema, schema["$defs"]


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """The node without $ref and without the ``null`` branch of an optional field."""
    if "anyOf" in node:
        branches = [b for b in node["anyOf"] if b.get("type") != "null"]
        assert len(branches) == 1, node
        merged = {k: v for k, v in node.items() if k != "anyOf"}
        merged.update(_resolve(branches[0], defs))
        if merged.get("default", ...) is None:
            del merged["default"]  # optional: absent in the CRD, None in the model
        return merged
    if "$ref" in node:
        merged = {k: v for k, v in node.items() if k != "$ref"}
        merged.update(defs[node["$ref"].rsplit("/", 1)[-1]])
        return merged
    return node


def _crd_bounds(node: dict[str, Any]) -> dict[str, Any]:
    out = {k: node[k] for k in KEYWORDS if k in node}
    for rule in node.get("x-kubernetes-validations", []):
        match = _CEL_BOUND.match(rule["rule"])
        if match:
            out["minimum" if match[1] == ">=" else "maximum"] = int(match[2])
    return out


def _pairs(crd: dict[str, Any], model: dict[str, Any], defs: dict[str, Any], path: str) -> list[str]:
    """Every disagreement between a CRD object schema and a model's, recursively."""
    model = _resolve(model, defs)
    found: list[str] = []
    crd_props, model_props = crd.get("properties", {}), model.get("properties", {})
    if set(crd_props) != set(model_props):
        found.append(f"{path}: CRD fields {sorted(crd_props)} != model fields {sorted(model_props)}")
    if set(crd.get("required", [])) != set(model.get("required", [])):
        found.append(f"{path}: required {crd.get('required')} != {model.get('required')}")
    for name in sorted(set(crd_props) & set(model_props)):
        here = f"{path}.{name}"
        c, m = crd_props[name], _resolve(model_props[name], defs)
        want = {k: m[k] for k in KEYWORDS if k in m and k != "title"}
        have = _crd_bounds(c)
        if c.get("type") == "object" and "properties" in c:
            have.pop("default", None)
            want.pop("default", None)
            found += _pairs(c, m, defs, here)
        elif c.get("type") == "array":
            want.pop("default", None)  # an empty list: the CRD leaves the field out instead
        if have != want:
            found.append(f"{here}: CRD {have} != model {want}")
        if (
            m.get("type")
            and c.get("type") != m["type"]
            and not (c.get("type") == "object" and m["type"] == "object")
        ):
            found.append(f"{here}: CRD type {c.get('type')} != model type {m['type']}")
    return found


def test_crd_spec_schema_is_the_models() -> None:
    schema, defs = model_spec()
    assert _pairs(crd_spec(), schema, defs, "spec") == []


def test_a_changed_bound_is_caught() -> None:
    crd = crd_spec()
    crd["properties"]["partitions"]["maximum"] = 9_999
    schema, defs = model_spec()
    assert any("spec.partitions" in line for line in _pairs(crd, schema, defs, "spec"))


@pytest.mark.parametrize(
    ("setting", "bound"),
    [
        ("partitions", s.PARTITIONS),
        ("max_depth", s.MAX_DEPTH),
        ("claim_ttl_s", s.CLAIM_TTL_S),
        ("max_attempts", s.MAX_ATTEMPTS),
        ("concurrency", s.CONCURRENCY),
        ("shutdown_grace_s", s.SHUTDOWN_GRACE_S),
    ],
)
def test_settings_and_spec_share_the_bound(setting: str, bound: s.Bound) -> None:
    def limits(field: Any) -> tuple[Any, Any]:
        ge = next(m.ge for m in field.metadata if hasattr(m, "ge"))
        le = next(m.le for m in field.metadata if hasattr(m, "le"))
        return ge, le

    assert limits(s.Settings.model_fields[setting]) == (bound.low, bound.high)
    spec_field = {"concurrency": _spec.Worker, "shutdown_grace_s": _spec.Worker}.get(
        setting, _spec.DispatchSpec
    )
    assert limits(spec_field.model_fields[setting]) == (bound.low, bound.high)


def test_the_claim_ttl_is_bounded_by_the_rto() -> None:
    assert s.CLAIM_TTL_S.high == s.RTO_S == 300
    problems = _validate.validate({"claimTtlSeconds": 301, "backend": "sqlite", "worker": {"image": "x"}})
    assert [str(p) for p in problems] == ["spec.claimTtlSeconds: must be at most 300"]


def test_invalid_fields_are_named_with_their_camel_case_path() -> None:
    problems = _validate.validate(
        {"backend": "sqlite", "worker": {"image": "x", "executor": {"timeoutSeconds": 0}, "logLevel": "LOUD"}}
    )
    assert {p.field for p in problems} == {"spec.worker.executor.timeoutSeconds", "spec.worker.logLevel"}
