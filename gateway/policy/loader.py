"""Text (YAML or JSON) → validated `PolicyDoc` → runtime `Policy`; errors name the path."""

from __future__ import annotations

import json
import re
from typing import Any

import orjson
import yaml
from pydantic import ValidationError

from gateway.errors import PolicyError
from gateway.policy.fields import NotANumber
from gateway.policy.model import Policy
from gateway.policy.schema import PolicyDoc, utc_text

Scalars = dict[tuple[str, ...], yaml.ScalarNode]  # a YAML document's values by path


def _path(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(p) for p in loc) or "(document)"


def _read(text: str | bytes, source: str) -> tuple[Any, Scalars]:
    """JSON as JSON, anything else as YAML. Not JSON through YAML: YAML 1.1 (PyYAML) refuses
    valid JSON with tab whitespace (Go's MarshalIndent, `jq --tab`) and reads an escaped
    surrogate pair (Python's json.dumps of a non-BMP character) as two lone surrogates.
    A key given twice in one mapping is refused in both: each would keep the last silently
    (a second `limits:` dropping the first's rps; a section appended at the end replacing
    the whole first one). With the data, a YAML document's scalars by path (JSON: none),
    for errors to name their line."""
    try:
        data = orjson.loads(text)
    except orjson.JSONDecodeError:
        pass
    else:
        _json_twice(text, source)
        return data, {}
    try:
        loader = yaml.SafeLoader(text)
        loader.name = source  # its errors' marks name the file, not "<byte string>"
        try:
            node = loader.get_single_node()
            if node is None:
                return None, {}
            scalars = _yaml_checks(node, source)
            return loader.construct_document(node), scalars
        finally:
            loader.dispose()
    except yaml.reader.ReaderError as exc:  # not text: a byte or character YAML refuses
        raise PolicyError([_not_text(text, exc)], source) from exc
    except (yaml.YAMLError, ValueError) as exc:  # ValueError: e.g. a timestamp of Feb 30
        raise PolicyError([f"(document): not valid YAML/JSON: {exc}"], source) from exc
    except RecursionError as exc:  # PyYAML composes and constructs recursively (orjson
        # refuses past 1024 levels and leaves such JSON to it): no policy nests like this
        raise PolicyError(["(document): nested too deeply"], source) from exc


def _not_text(text: str | bytes, exc: yaml.reader.ReaderError) -> str:
    """Where a document stops being text YAML reads, by line: a byte that is not UTF-8 (a
    file saved as Latin-1), or a control character."""
    at = exc.position
    if exc.encoding != "unicode" and isinstance(text, bytes):  # a byte it cannot decode
        line = text[:at].count(b"\n") + 1
        return (f"(document): not UTF-8 text: byte 0x{exc.character:02x} at line {line}, "
                f"byte offset {at} ({exc.reason}): save the file as UTF-8")
    chars = text if isinstance(text, str) else text.decode("utf-8", "replace")
    line = chars[:at].count("\n") + 1  # `at` counts characters here (encoding "unicode")
    return (f"(document): character U+{int(exc.character):04X} at line {line} is a "
            f"control character, which YAML does not allow: remove it")


class _Twice(Exception):
    pass


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise _Twice
    return out


class _Object(list[tuple[str, Any]]):
    """A JSON object as its pairs, in order, a key given twice included."""


def _json_twice(text: str | bytes, source: str) -> None:
    """orjson keeps the last of a key given twice: a pass of the standard library's parser
    finds them (and, only when there are some, a second one their paths)."""
    try:
        json.loads(text, object_pairs_hook=_unique)
        return
    except _Twice:
        pass
    problems: list[str] = []

    def walk(value: Any, path: tuple[str, ...]) -> None:
        if isinstance(value, _Object):
            seen: set[str] = set()
            for key, item in value:
                if key in seen:
                    problems.append(f"{_path(path)}: key {key!r} given twice: the first "
                                    "would be dropped without a word")
                seen.add(key)
                walk(item, (*path, key))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                walk(item, (*path, str(i)))

    walk(json.loads(text, object_pairs_hook=_Object), ())
    raise PolicyError(problems, source)


_INT = "tag:yaml.org,2002:int"
_FLOAT = "tag:yaml.org,2002:float"
_NOT_A_NAME = {"tag:yaml.org,2002:bool": "a boolean", "tag:yaml.org,2002:null": "null"}
_OCTAL = re.compile(r"[-+]?0[0-7_]+")  # PyYAML's (YAML 1.1) octal: 010 is 8


def _yaml_meaning(node: yaml.ScalarNode) -> str:
    """What a YAML 1.1 number means that its writer likely did not: "" when nothing."""
    if node.tag == _INT and _OCTAL.fullmatch(node.value):
        n = yaml.safe_load(node.value)
        return (f"{node.value} is octal in YAML 1.1, i.e. {n}: write {n}, or the number "
                "without its leading 0")
    if node.tag in (_INT, _FLOAT) and ":" in node.value:
        n = yaml.safe_load(node.value)
        return f"{node.value} is a base 60 number in YAML 1.1, i.e. {n}: write {n}"
    return ""


def _yaml_checks(root: yaml.Node, source: str) -> Scalars:
    """What YAML would read without a word as other than written, by path and line: a key
    given twice in one mapping (the last kept), a key YAML 1.1 reads as a boolean or null
    (a model named `on` or `no`), and YAML 1.1's octal (`010` is 8) and base
    60 (`1:30` is 90) numbers. Keys brought in by a merge (`<<: *anchor`) may be
    overridden: that is what a merge means. Returns the scalars it walked, by path."""
    problems: list[str] = []
    scalars: Scalars = {}
    done: set[int] = set()  # an alias is its anchor's node: walked once (and never in a loop)

    def walk(node: yaml.Node, path: tuple[str, ...]) -> None:
        if id(node) in done:
            return
        done.add(id(node))
        if isinstance(node, yaml.ScalarNode):
            scalars[path] = node
            if meaning := _yaml_meaning(node):
                problems.append(f"{_path(path)}: {meaning} (line {node.start_mark.line + 1})")
        elif isinstance(node, yaml.MappingNode):
            seen: dict[tuple[str, str], int] = {}
            for key, value in node.value:
                if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
                    walk(value, path)
                    continue
                line = key.start_mark.line + 1
                if (what := _NOT_A_NAME.get(key.tag)) is not None:
                    read = yaml.safe_load(key.value)
                    problems.append(f"{_path(path)}: key {key.value!r} is {what} in YAML 1.1 "
                                    f"({read!r}), not a name: quote it ('{key.value}') "
                                    f"(line {line})")
                first = seen.get((key.tag, key.value))
                if first is None:
                    seen[key.tag, key.value] = line
                else:
                    problems.append(f"{_path(path)}: key {key.value!r} given twice (lines "
                                    f"{first} and {line}): the first would be dropped "
                                    "without a word")
                walk(key, (*path, str(key.value), "[key]"))
                walk(value, (*path, str(key.value)))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                walk(item, (*path, str(i)))

    walk(root, ())
    if problems:
        raise PolicyError(problems, source)
    return scalars


def _not_a_number(path: str, error: NotANumber, node: yaml.ScalarNode | None) -> str:
    """`rps: 10k`: YAML 1.1 reads it as text, which spells no number. Named as written,
    with its line in YAML, and the number it likely means."""
    fix = f": write {error.fix}" if error.fix else ""
    if node is None:  # JSON, or a value YAML reached through an alias
        return f"{path}: {orjson.dumps(error.text).decode()} is text, not a number{fix}"
    line = node.start_mark.line + 1
    if node.style in ("'", '"'):
        quoted = f"{node.style}{node.value}{node.style}"
        return f"{path}: {quoted} (line {line}) is text, not a number{fix}"
    return f"{path}: {node.value} (line {line}) is read by YAML as text, not a number{fix}"


def parse_doc(text: str | bytes, source: str = "policy") -> PolicyDoc:
    """Parse and validate; raise PolicyError listing every problem with its path."""
    data, scalars = _read(text, source)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise PolicyError(["(document): must be a mapping"], source)
    try:
        doc = PolicyDoc.model_validate(data)
    except ValidationError as exc:
        problems = []
        for e in exc.errors():
            if isinstance(error := e.get("ctx", {}).get("error"), NotANumber):
                at = tuple(str(p) for p in e["loc"])
                problems.append(_not_a_number(_path(e["loc"]), error, scalars.get(at)))
            else:
                problems.append(f"{_path(e['loc'])}: {e['msg']}")
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
        for old in key.get("previous", []):
            old["until"] = utc_text(old["until"])
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
