"""What libraries log through the standard library (aiokafka, asyncio) comes out as the
same JSON lines as the gateway's own, with the logger's name: a bare text line among them
breaks a log pipeline. Warning and above, as before; below the configured level, nothing."""

from __future__ import annotations

import json
import logging

import pytest

from gateway import log as gateway_log


def _lines(err: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in err.splitlines() if line.strip()]


def test_a_library_warning_is_a_json_line(capsys: pytest.CaptureFixture[str]) -> None:
    gateway_log.configure("info", cache=False)
    logging.getLogger("aiokafka.conn").error('Unable connect to "%s"', "127.0.0.1:1")
    logging.getLogger("aiokafka").info("not shown: libraries speak from warning up")
    try:
        raise ZeroDivisionError("boom")
    except ZeroDivisionError:
        logging.getLogger("asyncio").exception("Task exception was never retrieved")
    lines = _lines(capsys.readouterr().err)  # every line parses as JSON
    assert [(x["logger"], x["level"]) for x in lines] == [
        ("aiokafka.conn", "error"), ("asyncio", "error")], lines
    assert lines[0]["event"] == 'Unable connect to "127.0.0.1:1"'
    assert "ZeroDivisionError: boom" in str(lines[1]["exception"])


def test_configured_twice_logs_once_and_follows_the_level(
        capsys: pytest.CaptureFixture[str]) -> None:
    gateway_log.configure("info", cache=False)
    gateway_log.configure("error", cache=False)
    logging.getLogger("aiokafka").warning("below error: not shown")
    logging.getLogger("aiokafka").error("shown once")
    assert [x["event"] for x in _lines(capsys.readouterr().err)] == ["shown once"]
    gateway_log.configure("info", cache=False)
