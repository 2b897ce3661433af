"""The Lua filter's own CPU per SSE chunk, under LuaJIT (lupa), against an older commit's.

    .venv/bin/python benchmarks/lua_per_chunk.py [--baseline REV] [--chunks N] [--quick]
        [--out benchmarks/results/lua_per_chunk.json]

Envoy runs `gateway/envoyconf/lua/metering.lua` for every chunk of every stream with the
Envoy metering source, so its cost is most of what that source adds to Envoy per chunk
(bench_sources measures the whole of it through a real Envoy). Here the same script runs
under the LuaJIT that Envoy embeds (lupa's luajit21), over one stream of N identical chat
chunks as the mock engine writes them, with a minimal stand-in for Envoy's handle (a table
store for metadata), in five shapes: counting only, hiding the injected `"usage": null`
(include_usage added by the gateway), hiding continuous usage, and, counted only, an
Anthropic Messages `content_block_delta` and a Responses API `response.output_text.delta`.
The figure is the best of 7 runs, in µs per chunk; the stand-in's own cost is in it and is
the same for every script.
With `--baseline REV`, REV's script runs in the same process, interleaved, and the table
shows the ratio.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path
from typing import Any

try:
    import lupa.luajit21 as lupa_rt
except ImportError:  # pragma: no cover - wheels without LuaJIT
    import lupa.lua51 as lupa_rt

from common import git_state, markdown_table

from gateway.envoyconf import lua as envoy_lua

ROOT = Path(__file__).resolve().parent.parent

LUA_PATH = "gateway/envoyconf/lua/metering.lua"
HEAD = (b'data: {"id":"chatcmpl-8b95d192518ed3538679960a","object":"chat.completion.chunk",'
        b'"created":1796132777,"model":"mock-model","system_fingerprint":"fp_mock","choices":'
        b'[{"index":0,"delta":{"content":" tok1"},"logprobs":null,"finish_reason":null}]')
SHAPES = {  # label -> (chunk, authz facts)
    "count only": (HEAD + b"}\n\n", {}),
    "hide usage:null": (HEAD + b',"usage":null}\n\n', {"hide_usage": True}),
    "hide continuous": (HEAD + b',"usage":{"prompt_tokens":9,"completion_tokens":2,'
                        b'"total_tokens":11}}\n\n', {"hide_continuous": True}),
    "messages delta": (b'event: content_block_delta\ndata: {"type":"content_block_delta",'
                       b'"index":0,"delta":{"type":"text_delta","text":" tok1"}}\n\n', {}),
    "responses delta": (b'event: response.output_text.delta\ndata: {"type":'
                        b'"response.output_text.delta","item_id":"msg_1","output_index":0,'
                        b'"content_index":0,"delta":" tok1","sequence_number":7}\n\n', {}),
}

HARNESS = rb"""
local Buf = {}; Buf.__index = Buf
function Buf:length() return #self.b end
function Buf:getBytes(i, n) return string.sub(self.b, i + 1, i + n) end
function Buf:setBytes(s) self.b = s end
local meta = {}
local M = {}
function M:get(ns) return meta[ns] end
function M:set(ns, k, v) local t = meta[ns]; if not t then t = {}; meta[ns] = t end; t[k] = v end
local SI = {}
function SI:dynamicMetadata() return M end
local H = {}
function H:get(k) if k == "content-type" then return "text/event-stream" end end
function H:remove(k) end
EnvoyTimestampResolution = { MILLISECOND = 0, MICROSECOND = 1 }
function bench(chunk, n, facts)
  meta = {["envoy.filters.http.ext_authz"] = facts}
  local handle = {}
  function handle:headers() return H end
  function handle:timestampString(r) return "1800000000000000" end
  function handle:streamInfo() return SI end
  function handle:bodyChunks()
    local i = 0
    return function()
      i = i + 1
      if i > n then return nil end
      return setmetatable({b = chunk}, Buf)
    end
  end
  local t0 = os.clock()
  envoy_on_response(handle)
  return os.clock() - t0
end
"""


def runtime(source: str) -> Any:
    lua = lupa_rt.LuaRuntime(encoding=None)
    lua.execute(source.encode())
    lua.execute(HARNESS)
    return lua


def per_chunk(lua: Any, chunk: bytes, facts: dict[str, Any], n: int) -> float:
    table = lua.table_from({k.encode(): v for k, v in facts.items()})
    return min(lua.globals().bench(chunk, n, table) for _ in range(7)) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", help="a commit whose Lua filter runs beside this one")
    ap.add_argument("--chunks", type=int, default=20000)
    ap.add_argument("--quick", action="store_true", help="2,000 chunks: a smoke test")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/lua_per_chunk.json")
    args = ap.parse_args()
    n = 2000 if args.quick else args.chunks
    scripts = {"this tree": runtime(envoy_lua.source())}
    if args.baseline:
        old = subprocess.run(["git", "show", f"{args.baseline}:{LUA_PATH}"], cwd=ROOT,
                             check=True, capture_output=True, text=True).stdout
        # its contract names filled in as this tree's renderer does (a superset of REV's):
        # left as the marker, they are nil and the first metadata write fails
        scripts[args.baseline] = runtime(old.replace(
            envoy_lua.MARKER, envoy_lua._constants(), 1))
    rows: list[dict[str, Any]] = []
    for shape, (chunk, facts) in SHAPES.items():
        row: dict[str, Any] = {"shape": shape}
        for label, lua in scripts.items():
            row[label] = round(per_chunk(lua, chunk, facts, n), 2)
        if args.baseline:
            row["x baseline"] = round(row["this tree"] / row[args.baseline], 2)
        rows.append(row)
    cols = tuple(rows[0])
    print(f"Lua filter, µs per chunk (LuaJIT via lupa, best of 7 x {n} chunks)")
    print("\n".join(markdown_table(cols, [tuple(str(r[c]) for c in cols) for r in rows])))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"git": git_state(), "chunks": n, "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
