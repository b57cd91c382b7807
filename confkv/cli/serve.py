"""The ``confkv serve`` subcommand: load a model and run the app under uvicorn (loopback by default)."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``serve`` to the ``confkv`` command's subparsers; the parsed args carry ``run``."""
    from confkv.cli.common import MODEL_HELP

    p = subparsers.add_parser("serve", help="an OpenAI-compatible server; each request may state its KV memory")
    p.add_argument("--model", default="smollm2", help=MODEL_HELP)
    p.add_argument("--served-name", default=None, help="the model id in /v1/models (default: --model)")
    p.add_argument("--memory", type=float, default=0.25,
                   help="default memory target of a request: this fraction (0, 1] of the full cache's bytes")
    p.add_argument("--max-kv-bytes", type=int, default=None, help="default memory target as a cap in bytes instead")
    p.add_argument("--policy", default=None, help="default policy or preset (default: the preset 'tiered')")
    p.add_argument("--param", action="append", metavar="KEY=VALUE", help="default policy parameter, repeatable")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--chunk", type=int, default=256,
                   help="prompt tokens per prefill forward: a new prompt stalls each running row by at most one "
                        "chunk per round")
    p.add_argument("--max-batch", type=int, default=8, help="requests decoding at once")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond them; then 429")
    p.add_argument("--max-tokens", type=int, default=256, help="new tokens when a request gives no max_tokens")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the model's dtype")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--log-level", default="info")
    p.add_argument("--ray", action="store_true",
                   help='run as a Ray Serve deployment (pip install "ray[serve]==2.60.0"): --replicas copies, '
                        "each with its own batch, behind Ray Serve\'s router on --host:--port")
    p.add_argument("--replicas", type=int, default=1, help="with --ray: replicas of the model and its engine")
    p.add_argument("--replica-cpus", type=float, default=1.0, help="with --ray: CPUs Ray reserves per replica")
    p.add_argument("--ray-address", default=None, help="with --ray: a running Ray cluster (default: a local Ray)")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn
    except ImportError:
        print('confkv serve needs the serve extra: pip install "confkv[serve]"')
        return 2
    import torch

    from confkv.cli.common import parse_params
    from confkv.models import load_model
    from confkv.serve.app import Server, create_app

    settings = {"model_name": args.served_name or args.model,
                "memory": None if args.max_kv_bytes is not None else args.memory,
                "max_kv_bytes": args.max_kv_bytes, "policy": args.policy, "params": parse_params(args.param),
                "chunk": args.chunk, "max_batch": args.max_batch, "max_queue": args.max_queue,
                "default_max_tokens": args.max_tokens}
    if args.ray:
        from confkv.serve import ray_serve

        return ray_serve.run(args, settings)
    model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype))
    server = Server(model, tokenizer, **settings)
    uvicorn.run(create_app(server), host=args.host, port=args.port, log_level=args.log_level)
    return 0


def serve_in_thread(app: Any, host: str = "127.0.0.1", port: int = 0) -> tuple[Any, Any, int]:
    """Run ``app`` under uvicorn in a background thread (tests, the load generator); returns
    ``(uvicorn server, thread, port)``. Stop with ``server.should_exit = True; thread.join()``."""
    import socket
    import threading
    import time

    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    config = uvicorn.Config(app, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    return server, thread, sock.getsockname()[1]
