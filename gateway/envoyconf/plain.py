"""Typed envoy-data-plane messages → the plain data Envoy's YAML loader expects.

proto3 JSON drops fields equal to their default, which would hide the `false`s a reviewer
looks for (`failure_mode_allow: false`); `to_plain` puts the ones it is told about back.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import betterproto2
from envoy_data_plane.message_pool import default_message_pool


@contextmanager
def quiet_imports() -> Iterator[None]:
    """Import envoy-data-plane's config modules inside this. Version 2.2.0 declares ~250
    `@model_validator(mode="after")` classmethods, each a PydanticDeprecatedSince212
    warning at import: noise in every test run, nothing to fix on our side. Only that
    message is silenced, and only while the modules load."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Using `@model_validator` with mode='after'")
        yield


SpelledOut = Mapping[type[betterproto2.Message], tuple[str, ...]]  # {type: dotted paths}


def to_plain(message: betterproto2.Message, spelled_out: SpelledOut) -> dict[str, Any]:
    """Proto3 JSON of `message` with snake_case keys, the `spelled_out` falses restored.

    A deprecated field we set is set on purpose (each says why where it is built): the
    library's warning when it re-reads one is silenced here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r".* is deprecated", DeprecationWarning)
        plain = message.to_dict(casing=betterproto2.Casing.SNAKE)
    by_url = {default_message_pool.type_to_url[cls]: paths for cls, paths in spelled_out.items()}
    _spell_out_false(plain, by_url)
    return plain


def _spell_out_false(node: Any, by_url: dict[str, tuple[str, ...]]) -> None:
    if isinstance(node, list):
        for item in node:
            _spell_out_false(item, by_url)
    if not isinstance(node, dict):
        return
    for path in by_url.get(node.get("@type", ""), ()):
        parent_path, _, leaf = path.rpartition(".")
        parent = node
        for key in filter(None, parent_path.split(".")):
            parent = parent.setdefault(key, {})
        parent.setdefault(leaf, False)
    for value in node.values():
        _spell_out_false(value, by_url)
