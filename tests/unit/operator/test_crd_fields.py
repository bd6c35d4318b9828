"""Each CRD field is declared once (``api.fields``), and the schema and the typed spec both come
from that declaration: adding a field is one edit in ``api/spec.py`` (or ``autoscaling_spec.py``)
plus whatever acts on it."""

from __future__ import annotations

from dataclasses import dataclass

from dsv4_operator.api.autoscaling_spec import AutoscalingSpec
from dsv4_operator.api.features_spec import FeaturesSpec
from dsv4_operator.api.fields import crd_object, from_crd, object_schema, prop
from dsv4_operator.api.observability_spec import ObservabilitySpec
from dsv4_operator.api.scheduling_spec import SchedulingSpec
from dsv4_operator.api.schema import string
from dsv4_operator.api.spec import (
    EngineSpec,
    GatewaySpec,
    KVTransferSpec,
    parse,
    spec_schema,
)

from .conftest import make_cr


# A scratch field, declared as every field of the spec is: the one edit a new field needs.
@crd_object(defaulted=True)
@dataclass(frozen=True, kw_only=True)
class _KVWithCompression(KVTransferSpec):
    compression: str = prop(
        string("How KV is compressed on the wire.", default="none", enum=["none", "lz4"])
    )


def test_a_field_declared_once_is_in_the_schema_and_the_parsed_spec() -> None:
    schema = object_schema(_KVWithCompression)
    assert schema["properties"]["compression"] == {
        "type": "string",
        "description": "How KV is compressed on the wire.",
        "default": "none",
        "enum": ["none", "lz4"],
    }
    assert schema["default"]["compression"] == "none"  # an absent kvTransfer gets it too
    # the section's other fields are unchanged, in the same order, the new one last
    kv = spec_schema()["properties"]["kvTransfer"]
    assert list(schema["properties"]) == [*kv["properties"], "compression"]
    # parsed: its default when unset, the value when set, as the attribute the operator reads
    assert from_crd(_KVWithCompression, {}).compression == "none"
    assert from_crd(_KVWithCompression, {"compression": "lz4", "port": 2000}) == (
        _KVWithCompression(compression="lz4", port=2000)
    )


def test_the_typed_defaults_are_the_crds() -> None:
    """Every section the minimal CR leaves out parses to the dataclass built with no
    arguments: the declared defaults are one, whichever way they are read."""
    spec = parse(make_cr())
    assert spec.engine == EngineSpec()
    assert spec.kv == KVTransferSpec()
    assert spec.gateway == GatewaySpec()
    assert spec.autoscaling == AutoscalingSpec()
    assert spec.scheduling == SchedulingSpec()
    assert spec.features == FeaturesSpec()
    assert spec.observability == ObservabilitySpec()
