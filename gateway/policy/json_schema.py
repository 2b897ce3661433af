"""The policy document's JSON Schema (draft 2020-12), as `gateway policy schema` prints it
and docs/policy.schema.json holds it: generated from the pydantic models of schema.py, whose
field types (fields.py) say what they accept as the loader reads it (`1e6` as text, an
instant with its offset, a key id's pattern...). For editors (yaml-language-server) and CI,
before `policy apply` / `hub publish`: what it cannot say is in its description."""

from __future__ import annotations

import json
from typing import Any

from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue
from pydantic_core import core_schema

from gateway.policy.schema import PolicyDoc

DIALECT = "https://json-schema.org/draft/2020-12/schema"
TITLE = "gateway policy document"
DESCRIPTION = (
    "The policy a gateway spoke enforces (`gateway policy apply FILE`, `gateway hub publish "
    "FILE`), YAML or JSON: models, teams, keys, passthrough paths, billing. This schema "
    "checks each field on its own, as the loader does: unknown fields, types, ranges, "
    "patterns. What spans fields is the loader's alone: a key's team must exist, no two "
    "digests (current or previous) may be equal, an ACL entry naming one model must name a "
    "model of `models`, `burst` needs `rps`, two prices of a model may not share "
    "`effective`; and `policy apply`'s safety rules (no empty document, no removed keys "
    "without --prune). Numbers written as text (`1e6`, which YAML 1.1 reads as text) are "
    "checked for their sign and, in whole-number fields, for a fraction, not against the "
    "range; an instant's day is not checked against its month's length; YAML 1.1's own "
    "readings (`010` octal, `1:30` base 60, a key `on` or `no`) are refused by the loader "
    "only. A document this schema refuses, the loader refuses too (but for a number spelled in "
    "non-ASCII digits, which the loader reads).")


class _PolicySchema(GenerateJsonSchema):
    """pydantic's, except that a mapping's key constraints all go to `propertyNames` (pydantic
    puts a key's pattern in `patternProperties`, where a key not matching it is simply not
    checked, neither as a key nor its value)."""

    def dict_schema(self, schema: core_schema.DictSchema) -> JsonSchemaValue:
        out = super().dict_schema(schema)
        patterns = out.pop("patternProperties", None)
        if patterns:
            ((pattern, values),) = patterns.items()
            out["additionalProperties"] = values
            out["propertyNames"] = {**out.get("propertyNames", {}), "pattern": pattern}
        return out


def policy_json_schema() -> dict[str, Any]:
    """The schema, `$schema`, `title` and `description` first; no `$id` (where it is
    served is the reader's)."""
    body = PolicyDoc.model_json_schema(schema_generator=_PolicySchema, mode="validation")
    body.pop("title", None)
    return {"$schema": DIALECT, "title": TITLE, "description": DESCRIPTION, **body}


def policy_json_schema_text() -> str:
    """As printed and committed: indented, keys in the models' order, a final newline."""
    return json.dumps(policy_json_schema(), indent=2, ensure_ascii=False) + "\n"
