"""The engine tests' tiny model (testkit/tiny_model.py), without an engine: the same bytes
every time, and an output layer that can only ever pick printable tokens."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from testkit import tiny_model


def test_the_same_model_every_time(tmp_path: Path) -> None:
    a = tiny_model.write_gguf(tiny_model.build(200), tmp_path / "a.gguf").read_bytes()
    b = tiny_model.write_gguf(tiny_model.build(200), tmp_path / "b.gguf").read_bytes()
    assert a == b and len(a) > 100_000


def test_only_printable_tokens_can_win() -> None:
    """The constant embedding dimension times the output bias: -500 for every special and
    unprintable token, far below anything the random weights reach, so no answer ends early
    and every streamed token is printable ASCII."""
    m = tiny_model.build(200)
    bias = m.tensors["output.weight"][:, 0]
    forbidden = {i for i, b in enumerate(bias) if b < 0}
    alphabet = {c: b for b, c in tiny_model.byte_alphabet().items()}
    for i, tok in enumerate(m.tokens):
        special = tok in tiny_model.SPECIALS
        printable = not special and all(
            32 <= alphabet[ch] < 127 or alphabet[ch] == 10 for ch in tok)
        assert (i in forbidden) == (not printable), tok
    assert {m.eot, m.im_end} <= forbidden


def test_hf_layout_holds_the_same_weights_and_ids(tmp_path: Path) -> None:
    m = tiny_model.build(200)
    out = tiny_model.write_hf(m, tmp_path / "hf")
    raw = (out / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    meta = header["model.layers.1.self_attn.q_proj.weight"]
    start, end = meta["data_offsets"]
    q = np.frombuffer(raw[8 + n + start:8 + n + end], dtype="<f4").reshape(meta["shape"])
    assert np.array_equal(q, m.tensors["blk.1.attn_q.weight"])
    assert len(header) - 1 == len(m.tensors)  # every tensor, plus __metadata__
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    assert [vocab.get(t, -1) for t in m.tokens[:-3]] == list(range(len(m.tokens) - 3))
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == m.im_end and config["vocab_size"] == len(m.tokens)
