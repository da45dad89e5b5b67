"""`specee serve`: the OpenAI-compatible server (specee/server) under uvicorn, on loopback by default."""
from __future__ import annotations

import argparse
import errno
import os
import socket

from ..engine.scheduling import DEFAULT_MAX_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, DEFAULT_MAX_QUEUE, DEFAULT_PREFILL_CHUNK
from .arg_types import port_number, positive_int, prefill_chunk_arg
from .args import CLIError, add_early_exit_args, add_model_args, add_speculative_args, llm_options, load_llm

API_KEY_ENV = "SPECEE_API_KEY"


def add_serve_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                       description="Serve /v1/chat/completions, /v1/completions, /v1/models, /tokenize, "
                                   "/detokenize, /health, /metrics and a chat page at /. Needs the server "
                                   "extra: pip install 'specee[server]'.")
    add_model_args(p, fastest=True)
    add_early_exit_args(p)
    add_speculative_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    g.add_argument("--port", type=port_number, default=8000, help="port (default: 8000)")
    g.add_argument("--api-key", default=os.environ.get(API_KEY_ENV), metavar="KEY",
                   help=f"require `Authorization: Bearer KEY` on every route but /health and / "
                        f"(default: ${API_KEY_ENV}, else none)")
    g.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model id clients send (default: the checkpoint's directory or file name)")
    g.add_argument("--max-num-seqs", type=positive_int, default=DEFAULT_MAX_NUM_SEQS, metavar="N",
                   help=f"requests decoded at once; later ones wait (default: {DEFAULT_MAX_NUM_SEQS})")
    g.add_argument("--max-queue", type=positive_int, default=DEFAULT_MAX_QUEUE, metavar="N",
                   help=f"requests that may wait; beyond it 429 with Retry-After (default: {DEFAULT_MAX_QUEUE})")
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=DEFAULT_MAX_BATCHED_TOKENS, metavar="N",
                   help="rows a step runs: one per decoding request, plus prompt parts (a step may pass it by one "
                        f"part) (default: {DEFAULT_MAX_BATCHED_TOKENS})")
    g.add_argument("--prefill-chunk", type=prefill_chunk_arg, default=DEFAULT_PREFILL_CHUNK, metavar="N",
                   help="a longer prompt prefills N tokens a step, so that running requests keep streaming meanwhile; "
                        f"0: whole prompts (default: {DEFAULT_PREFILL_CHUNK})")
    r = p.add_argument_group("Ray Serve (pip install 'ray[serve]')")
    r.add_argument("--ray", action="store_true",
                   help="serve the same app as a Ray Serve deployment: replicas over a Ray cluster (RAY_ADDRESS, "
                        "else a new local one), restarted by Ray when they die")
    r.add_argument("--replicas", type=positive_int, default=1, metavar="N",
                   help="with --ray: engine replicas, one CPU each (default: 1)")
    p.set_defaults(func=cmd_serve)
    return p


def served_name(model_dir) -> str:
    return model_dir.stem if model_dir.suffix == ".gguf" else model_dir.name


def load_warm_llm(args: argparse.Namespace, options: dict | None = None):
    """The LLM a server serves, warmed up (`LLM.warm_up`) before it reports ready."""
    llm = load_llm(args, options)
    llm.warm_up()
    return llm


def check_address(host: str, port: int) -> None:
    """--host / --port that cannot be listened on, in one line before anything loads: uvicorn found out
    only after start-up and said so in its own log lines (a busy port: exit status 3). Bound as uvicorn
    binds (its family rule, SO_REUSEADDR), then let go; a server that takes the port meanwhile still
    fails in uvicorn."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except socket.gaierror as e:
            raise CLIError(f"--host: {host!r} is not a known address ({e.strerror})") from None
        except OSError as e:
            if e.errno == errno.EADDRNOTAVAIL:
                raise CLIError(f"--host: {host!r} is not an address of this machine ({e.strerror})") from None
            raise CLIError(f"--port: cannot listen on {host}:{port} ({e.strerror})") from None


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from ..server import create_app
    except ImportError as e:
        raise CLIError(f"specee serve needs the server extra ({e.name} is missing): pip install 'specee[server]'") \
            from None
    if args.replicas != 1 and not args.ray:
        raise CLIError(f"--replicas {args.replicas} needs --ray (without it one process serves one engine)")
    if args.api_key is not None and not args.api_key.strip():
        raise CLIError(f"--api-key (or ${API_KEY_ENV}) is empty: any client sending a bare "
                       "'Authorization: Bearer' header would pass; give a key, or leave it unset for none")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise CLIError("--served-model-name is empty: clients name the model they ask for")
    options = llm_options(args)  # a wrong path or flag fails before the server starts
    model_dir = options["model"]
    # (--max-num-seqs reaches the engine with the LLM's other scheduling settings: cli/args.py's scheduling)
    app_options = dict(model_name=args.served_model_name or served_name(model_dir), api_key=args.api_key,
                       max_queue=args.max_queue)
    if not (args.ray and os.environ.get("RAY_ADDRESS")):  # a remote Ray cluster's proxy binds on its own head
        check_address(args.host, args.port)
    if args.ray:
        return serve_on_ray(args, app_options)
    failed: list[str] = []

    def on_load_error(message: str) -> None:
        failed.append(message)
        server.should_exit = True

    app = create_app(load=lambda: load_warm_llm(args, options), on_load_error=on_load_error, **app_options)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, timeout_graceful_shutdown=3))
    server.run()
    if failed:
        raise CLIError(failed[0])
    return 0


RAY_AT_LEAST = "2.60"  # the Ray the tests run (requirements-ci.txt; pyproject's [ray] extra says the same)


def serve_on_ray(args: argparse.Namespace, app_options: dict) -> int:
    try:
        from ..server.ray_serve import run
    except ImportError as e:
        raise CLIError(f"--ray needs Ray Serve ({e.name} is missing): pip install 'ray[serve]'") from None
    except TypeError:  # an older Ray's serve.ingress needs its app: no argument-less form, no builder hook
        import ray

        raise CLIError(f"--ray needs Ray Serve {RAY_AT_LEAST} or newer (this is {ray.__version__}): "
                       f"pip install 'ray[serve]>={RAY_AT_LEAST}'") from None
    options = {k: v for k, v in vars(args).items() if k != "func"}
    run(options, app_options, replicas=args.replicas, host=args.host, port=args.port)
    return 0
