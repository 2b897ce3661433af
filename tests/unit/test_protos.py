"""The generated code (the usage event, the OTLP messages) must match protos/: a .proto edit
without `make protos` fails."""

from gateway import protos_build


def test_generated_code_is_fresh() -> None:
    assert protos_build.stale() == []


def test_staleness_is_detected(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "_proto"
    protos_build.compile_to(out)
    generated = next(out.rglob("usage_pb2.py"))
    generated.write_text(generated.read_text() + "\n# edited by hand\n")
    monkeypatch.setattr(protos_build, "OUT", out)
    assert protos_build.stale() == ["gateway/usage/v1/usage_pb2.py"]
