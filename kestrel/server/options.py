"""The serve command's own options (kept free of server imports so the CLI loads anywhere)."""

from __future__ import annotations

import argparse


def add_serve_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a checkpoint directory, a .gguf file, or a Hugging Face model id")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--max-queue-len", type=int, default=1024, help="requests waiting beyond max-num-seqs")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0)
    parser.add_argument("--uvicorn-log-level", default="warning")
    parser.add_argument(
        "--max-request-body-mb", type=float, default=32.0, help="larger request bodies get 413 before being read"
    )
    parser.add_argument(
        "--disable-log-requests", action="store_true", help="no info line per finished request (id, lengths, time)"
    )
    parser.add_argument(
        "--disable-log-stats", action="store_true", help="no periodic engine stats (running, waiting, KV, tokens/s)"
    )
