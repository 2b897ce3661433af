"""llama.cpp's own HTTP server (the `xllamacpp` wheel: no compiler) serving one GGUF file.

Run as a process (`python tests/engines/llamacpp_engine.py --model F --port P --alias A`)
so the tests own it like any other service and a SIGTERM ends it. One thread: two spin
against the other processes of a shared 2-core machine (a 64-token stream went from 14 ms
to 1.2 s). Four slots, so concurrent streams run side by side.
"""

from __future__ import annotations

import argparse
import signal
import sys

import xllamacpp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--alias", required=True, help="the model name it reports")
    parser.add_argument("--slots", type=int, default=4)
    args = parser.parse_args()
    params = xllamacpp.CommonParams()
    params.model.path = args.model
    params.model_alias = {args.alias}  # a set of names: a plain string is read letter by letter
    params.hostnames = ["127.0.0.1"]
    params.port = args.port
    params.n_ctx = 4096 * args.slots  # each slot gets the model's whole context
    params.n_parallel = args.slots
    params.cpuparams.n_threads = 1
    params.cpuparams_batch.n_threads = 1
    server = xllamacpp.Server(params)  # serves from its own threads
    print(f"llama.cpp server on 127.0.0.1:{args.port}", flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    del server
    sys.exit(0)


if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    main()
