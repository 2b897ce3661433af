"""Text (YAML or JSON) → validated `PolicyDoc` → runtime `Policy`; errors name the path."""

from __future__ import annotations

from typing import Any

import orjson
import yaml
from pydantic import ValidationError

from gateway.errors import PolicyError
from gateway.policy.model import Policy
from gateway.policy.schema import PolicyDoc, utc_text


def _path(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(p) for p in loc) or "(document)"


def _read(text: str | bytes, source: str) -> Any:
    """JSON as JSON, anything else as YAML. Not JSON through YAML: YAML 1.1 (PyYAML) refuses
    valid JSON with tab whitespace (Go's MarshalIndent, `jq --tab`) and reads an escaped
    surrogate pair (Python's json.dumps of a non-BMP character) as two lone surrogates."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        pass
    try:
        return yaml.safe_load(text)
    except (yaml.YAMLError, ValueError) as exc:  # ValueError: e.g. a timestamp of Feb 30
        raise PolicyError([f"(document): not valid YAML/JSON: {exc}"], source) from exc


def parse_doc(text: str | bytes, source: str = "policy") -> PolicyDoc:
    """Parse and validate; raise PolicyError listing every problem with its path."""
    data = _read(text, source)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise PolicyError(["(document): must be a mapping"], source)
    try:
        doc = PolicyDoc.model_validate(data)
    except ValidationError as exc:
        problems = [f"{_path(e['loc'])}: {e['msg']}" for e in exc.errors()]
        raise PolicyError(problems, source) from exc
    cross = doc.cross_problems()
    if cross:
        raise PolicyError(cross, source)
    return doc


def load(text: str | bytes, revision: int | None = None, source: str = "policy") -> Policy:
    doc = parse_doc(text, source)
    rev = revision if revision is not None else (doc.revision or 0)
    return Policy.compile(doc, rev)


def to_data(doc: PolicyDoc, revision: int | None = None) -> dict[str, Any]:
    """The document as plain data, minimal (defaults left out), ready to dump and re-apply."""
    data = doc.model_dump(mode="python", exclude_none=True, exclude_defaults=True)
    for key in data.get("keys", {}).values():
        if "expires_at" in key:
            key["expires_at"] = utc_text(key["expires_at"])
    for model in data.get("models", {}).values():
        for price in model.get("prices", []):
            price["effective"] = utc_text(price["effective"])
    data.pop("revision", None)
    out: dict[str, Any] = {"revision": revision} if revision else {}
    out.update(data)
    return out


def dump_yaml(doc: PolicyDoc, revision: int | None = None) -> str:
    return yaml.safe_dump(to_data(doc, revision), sort_keys=False)


def dump_json(doc: PolicyDoc, revision: int | None = None) -> bytes:
    return orjson.dumps(to_data(doc, revision), option=orjson.OPT_INDENT_2)
