"""The serve command's own options (kept free of server imports so the CLI loads anywhere)."""

from __future__ import annotations

import argparse

from kestrel.sampling_params import MAX_LOGPROBS
from kestrel.server.tool_parsers import TOOL_CALL_PARSERS


def add_serve_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", help="a checkpoint directory, a .gguf file, or a Hugging Face model id")
    parser.add_argument("--model", dest="model_option", default=None, help="the model, as a flag (vLLM accepts both)")
    parser.add_argument("--host", default="0.0.0.0", help="the address to listen on; all interfaces by default")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None)
    parser.add_argument(
        "--served-model-name", nargs="+", default=None, help="names requests may use; the first is the one reported"
    )
    parser.add_argument("--chat-template", default=None, help="a Jinja chat template, or a file holding one")
    parser.add_argument("--root-path", default="", help="the path prefix a proxy serves the API under")
    parser.add_argument("--allowed-origins", default='["*"]', help="CORS origins, a JSON list")
    parser.add_argument("--ssl-keyfile", default=None)
    parser.add_argument("--ssl-certfile", default=None)
    parser.add_argument(
        "--max-logprobs",
        type=int,
        default=MAX_LOGPROBS,
        help=f"the most logprobs a request may ask for (<= {MAX_LOGPROBS})",
    )
    parser.add_argument(
        "--generation-config",
        default="auto",
        choices=["auto", "vllm"],
        help="Kestrel reads only eos ids from generation_config.json; sampling defaults are vLLM's either way",
    )
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
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide when to call tools (tool_choice "auto"); needs --tool-call-parser',
    )
    parser.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_CALL_PARSERS),
        help="the format the model writes tool calls in",
    )
    parser.add_argument(
        "--disable-log-stats", action="store_true", help="no periodic engine stats (running, waiting, KV, tokens/s)"
    )
    parser.add_argument(
        "--kv-role",
        default=None,
        choices=["prefill", "decode"],
        help="disaggregated serving: compute prompts and hand their state to decode instances (prefill), "
        "or start from a prefill instance's state (decode); `kestrel router` sends each request to both",
    )
    parser.add_argument(
        "--kv-buffer-device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="prefill instances: where a computed prompt's state waits for its decode instance: host memory, "
        "fetched as bytes over TCP (cpu), or the GPU, copied by a decode instance on the same host through "
        "CUDA IPC (cuda)",
    )
    parser.add_argument(
        "--kv-transfer-timeout",
        type=float,
        default=60.0,
        help="prefill instances: seconds a computed prompt's state waits to be fetched before it is dropped",
    )


def add_router_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", nargs="+", required=True, help="prefill instances' base URLs")
    parser.add_argument("--decode", nargs="+", required=True, help="decode instances' base URLs")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds an instance may take to answer")
