"""A tiny random-weights llama model for real engines, made here (no model hub, no GPU).

Why this shape: the engine tests need an engine that answers in milliseconds and always
does the same thing. Two layers of width 64 (two heads of 32: vLLM's CPU attention needs
head_dim >= 32), f32, a byte-level BPE vocabulary learned from Debian's license texts, and
ChatML. One embedding dimension is a constant that the output layer turns into a bias
forbidding end-of-text and every non-printable token: every answer runs exactly to
`max_tokens` (`finish_reason: "length"`) and each SSE chunk carries one printable token.
Same seed, same corpus: the same bytes on every run.

`write_gguf` writes the file llama.cpp serves; `write_hf` the same weights and token ids in
the Hugging Face layout vLLM loads (safetensors written directly: no torch needed).
"""

from __future__ import annotations

import collections
import itertools
import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

CORPUS_DIR = Path("/usr/share/common-licenses")  # Debian base-files: the same on every box
FALLBACK = "The quick brown fox jumps over the lazy dog. Hello world, a tiny model. " * 500
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
N_EMBD, N_LAYER, N_HEAD, N_FF, CONTEXT = 64, 2, 2, 128, 4096
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
_WORDS = re.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+")


def byte_alphabet() -> dict[int, str]:
    """GPT-2's map of the 256 bytes to printable characters (BPE works on those)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars = dict(zip(keep, keep, strict=True))
    extra = 256
    for b in range(256):
        if b not in chars:
            chars[b] = extra
            extra += 1
    return {b: chr(c) for b, c in sorted(chars.items())}


def corpus_text() -> str:
    parts = []
    for f in sorted(CORPUS_DIR.glob("*")) if CORPUS_DIR.is_dir() else []:
        if f.is_file():
            parts.append(f.read_bytes().decode("ascii", "ignore"))
    text = "\n".join(parts)
    return text if len(text) >= 10_000 else FALLBACK


def learn_merges(text: str, n_merges: int, alphabet: dict[int, str]) -> list[tuple[str, str]]:
    """Byte-level BPE merges, most frequent pair first (ties: the larger pair), with the pair
    counts kept up to date incrementally (a full recount per merge takes minutes)."""
    counts = collections.Counter("".join(alphabet[b] for b in w.encode())
                                 for w in _WORDS.findall(text))
    words = [(list(w), c) for w, c in counts.items()]
    pairs: collections.Counter[tuple[str, str]] = collections.Counter()
    where: dict[tuple[str, str], set[int]] = collections.defaultdict(set)
    for i, (sym, c) in enumerate(words):
        for p in itertools.pairwise(sym):
            pairs[p] += c
            where[p].add(i)
    merges: list[tuple[str, str]] = []
    while pairs and len(merges) < n_merges:
        a, b = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))[0]
        merges.append((a, b))
        for i in list(where[(a, b)]):
            sym, c = words[i]
            for p in itertools.pairwise(sym):
                pairs[p] -= c
                if pairs[p] <= 0:
                    del pairs[p]
                where[p].discard(i)
            merged, j = [], 0
            while j < len(sym):
                if j + 1 < len(sym) and sym[j] == a and sym[j + 1] == b:
                    merged.append(a + b)
                    j += 2
                else:
                    merged.append(sym[j])
                    j += 1
            words[i] = (merged, c)
            for p in itertools.pairwise(merged):
                pairs[p] += c
                where[p].add(i)
    return merges


@dataclass
class TinyModel:
    tokens: list[str]  # the vocabulary, then SPECIALS
    merges: list[tuple[str, str]]
    tensors: dict[str, np.ndarray]  # GGUF names, numpy shape (out, in)

    @property
    def eot(self) -> int:
        return len(self.tokens) - 3

    @property
    def im_end(self) -> int:
        return len(self.tokens) - 1


def build(n_merges: int = 1000, seed: int = 1234) -> TinyModel:
    alphabet = byte_alphabet()
    merges = learn_merges(corpus_text(), n_merges, alphabet)
    vocab = [alphabet[b] for b in range(256)]
    seen = set(vocab)
    for a, b in merges:
        if a + b not in seen:
            vocab.append(a + b)
            seen.add(a + b)
    to_byte = {c: b for b, c in alphabet.items()}
    printable = np.array(
        [all(32 <= to_byte[ch] < 127 or to_byte[ch] == 10 for ch in t) for t in vocab]
        + [False] * len(SPECIALS))
    n_vocab = len(vocab) + len(SPECIALS)
    rng = np.random.default_rng(seed)

    def small(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    embed = rng.standard_normal((n_vocab, N_EMBD)).astype(np.float32)
    embed[:, 0] = 5.0  # the constant dimension the output bias rides on
    output = (rng.standard_normal((n_vocab, N_EMBD)) * 0.5).astype(np.float32)
    output[:, 0] = 0.0
    output[~printable, 0] = -100.0  # never end, never a special or unprintable token
    ones = np.ones(N_EMBD, dtype=np.float32)
    t: dict[str, np.ndarray] = {"token_embd.weight": embed, "output_norm.weight": ones,
                                "output.weight": output}
    for i in range(N_LAYER):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = ones
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            t[p + name + ".weight"] = small(N_EMBD, N_EMBD)
        t[p + "ffn_norm.weight"] = ones
        t[p + "ffn_gate.weight"] = small(N_FF, N_EMBD)
        t[p + "ffn_up.weight"] = small(N_FF, N_EMBD)
        t[p + "ffn_down.weight"] = small(N_EMBD, N_FF)
    return TinyModel([*vocab, *SPECIALS], merges, t)


def write_gguf(model: TinyModel, path: Path) -> Path:
    import gguf  # the test extras' writer of llama.cpp's format

    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_name("tiny-random-llama")
    w.add_context_length(CONTEXT)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD)
    w.add_rope_dimension_count(N_EMBD // N_HEAD)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_vocab_size(len(model.tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(model.tokens)
    n_normal = len(model.tokens) - len(SPECIALS)
    w.add_token_types([gguf.TokenType.NORMAL] * n_normal
                      + [gguf.TokenType.CONTROL] * len(SPECIALS))
    w.add_token_merges([f"{a} {b}" for a, b in model.merges])
    w.add_bos_token_id(model.eot)
    w.add_eos_token_id(model.im_end)
    w.add_eot_token_id(model.im_end)
    w.add_pad_token_id(model.eot)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    for name, arr in model.tensors.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


_HF_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
             "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def hf_name(gguf_name: str) -> str:
    top = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
           "output_norm.weight": "model.norm.weight"}
    if gguf_name in top:
        return top[gguf_name]
    _, layer, part, _ = gguf_name.split(".")
    return f"model.layers.{layer}.{_HF_NAMES[part]}.weight"


def write_safetensors(tensors: dict[str, np.ndarray], path: Path) -> None:
    """The safetensors layout: an 8-byte header length, a JSON header, the raw tensors."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset, blobs = 0, []
    for name, arr in tensors.items():
        blob = np.ascontiguousarray(arr, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def write_hf(model: TinyModel, out: Path) -> Path:
    """The same model for vLLM: config, weights and a tokenizer with the same token ids."""
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors({hf_name(k): v for k, v in model.tensors.items()},
                      out / "model.safetensors")
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": len(model.tokens), "hidden_size": N_EMBD, "intermediate_size": N_FF,
        "num_hidden_layers": N_LAYER, "num_attention_heads": N_HEAD,
        "num_key_value_heads": N_HEAD, "max_position_embeddings": CONTEXT,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "hidden_act": "silu", "bos_token_id": model.eot, "eos_token_id": model.im_end,
        "pad_token_id": model.eot, "torch_dtype": "float32"}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": model.im_end, "pad_token_id": model.eot}))
    n_normal = len(model.tokens) - len(SPECIALS)
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                  "use_regex": True}
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": n_normal + i, "content": s, "single_word": False,
                          "lstrip": False, "rstrip": False, "normalized": False,
                          "special": True} for i, s in enumerate(SPECIALS)],
        "normalizer": None, "pre_tokenizer": byte_level, "post_processor": None,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(model.tokens)},
                  "merges": [[a, b] for a, b in model.merges]}}
    (out / "tokenizer.json").write_text(json.dumps(tokenizer))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False,
        "bos_token": SPECIALS[0], "eos_token": SPECIALS[2], "pad_token": SPECIALS[0],
        "model_max_length": CONTEXT, "chat_template": CHATML}))
    (out / "special_tokens_map.json").write_text(json.dumps({
        "bos_token": SPECIALS[0], "eos_token": SPECIALS[2], "pad_token": SPECIALS[0]}))
    return out


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf", type=Path, help="where to write the GGUF file")
    parser.add_argument("--hf", type=Path, help="also write the HF layout into this directory")
    parser.add_argument("--merges", type=int, default=1000)
    args = parser.parse_args()
    model = build(args.merges)
    write_gguf(model, args.gguf)
    if args.hf:
        write_hf(model, args.hf)
    print(f"wrote {args.gguf}: vocab {len(model.tokens)}, merges {len(model.merges)}")


if __name__ == "__main__":
    main()
