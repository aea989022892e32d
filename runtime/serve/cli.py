"""`paradecode-serve DIR`: serve an export over OpenAI's HTTP API (uvicorn, or Ray Serve with --ray).

Exit codes: 2 bad input or a bad export, 3 a missing library (the `serve` or `ray` extra), and after
SIGTERM or Ctrl-C, once in-flight requests have finished (or were cancelled after
--shutdown-timeout), 143 or 130.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from contextlib import contextmanager

from paradecode.graphs.arguments import non_negative_int, positive_float, positive_int
from paradecode.graphs.errors import MissingDependencyError, UserInputError, run_command

PROG = "paradecode-serve"
logger = logging.getLogger("paradecode.serve")


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({err.msg})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"max_replicas\": 4}}', got {text!r}")
    return value


def default(config_class, name: str) -> str:
    """A config field's default, for a help text (the defaults live in the config classes only)."""
    return str(config_class.__dataclass_fields__[name].default)


def build_parser() -> argparse.ArgumentParser:
    from paradecode.runtime.backends import BACKENDS
    from paradecode.runtime.decoding_flags import SERVED, add_decoding_flags
    from paradecode.runtime.serve.config import RayConfig, ServeConfig

    serve_default = lambda name: default(ServeConfig, name)
    ray_default = lambda name: default(RayConfig, name)

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Serve a paradecode export over OpenAI's HTTP API: /v1/completions, /v1/chat/completions "
        "(streamed as Server-Sent Events with stream=true), /v1/models, /health and Prometheus /metrics.",
    )
    parser.add_argument("export", metavar="DIR", help="a folder written by paradecode-export")
    parser.add_argument(
        "--host", help=f"address to listen on (default {serve_default('host')}; 0.0.0.0: every interface)"
    )
    parser.add_argument(
        "--port", type=non_negative_int, help=f"port (default {serve_default('port')}; 0: any free port, logged)"
    )
    parser.add_argument(
        "--served-model-name", metavar="NAME", help="the model name clients send (default: DIR's folder name)"
    )
    load = parser.add_argument_group("replicas and limits")
    load.add_argument(
        "--replicas",
        type=positive_int,
        help=f"models loaded (default {serve_default('replicas')}); each holds its own weights, KV cache and lanes",
    )
    load.add_argument(
        "--max-batch",
        type=positive_int,
        metavar="B",
        help="requests a replica decodes together, in one batched call per subgraph (default: the export's "
        "--max-batch; 1: one at a time)",
    )
    load.add_argument(
        "--prefill-tokens",
        type=positive_int,
        metavar="N",
        help="prompt tokens a batch prefills between two decoding steps, at least one request's "
        f"(default {serve_default('prefill_tokens')})",
    )
    load.add_argument(
        "--max-queue",
        type=non_negative_int,
        help=f"requests waiting for a replica (default {serve_default('max_queue')})",
    )
    load.add_argument(
        "--request-timeout",
        type=positive_float,
        metavar="S",
        help=f"seconds per request, from its arrival to its last token: reading, preparing and queueing included "
        f"(default {serve_default('request_timeout')})",
    )
    load.add_argument(
        "--read-timeout",
        type=positive_float,
        metavar="S",
        help=f"seconds a client has to send a request's headers, and then its body; a slower one is disconnected "
        f"(default {serve_default('read_timeout')})",
    )
    load.add_argument(
        "--shutdown-timeout",
        type=positive_float,
        metavar="S",
        help="seconds in-flight requests get after SIGTERM; then each gets a 503 (a stream: an error event and "
        f"[DONE]) (default {serve_default('shutdown_timeout')})",
    )
    load.add_argument(
        "--max-body-bytes",
        type=positive_int,
        metavar="N",
        help=f"largest request body (default {serve_default('max_body_bytes')})",
    )
    load.add_argument(
        "--max-preparing-bytes",
        type=positive_int,
        metavar="N",
        help="bytes of request bodies being parsed and tokenized or waiting for it, all requests together: of those "
        "over 64 KiB, and as many of smaller ones; a body past it gets 429 with Retry-After; at least "
        f"--max-body-bytes (default {serve_default('max_preparing_bytes')})",
    )
    load.add_argument("--backend", choices=tuple(BACKENDS), help=f"default {serve_default('backend')}")
    load.add_argument("--device", choices=("cpu", "cuda"), help=f"default {serve_default('device')}")
    load.add_argument("--lanes", type=positive_int, help=f"lanes per replica (default {serve_default('lanes')})")
    load.add_argument("--threads", type=positive_int, help="onnxruntime threads per call (default: cores / all lanes)")
    load.add_argument(
        "--compile",
        action="store_true",
        help="torch backend: compile the model's modules with torch.compile; each replica compiles before the server "
        "listens",
    )
    load.add_argument(
        "--no-verify",
        action="store_true",
        help="skip hashing the export's other files on load (the files a backend computes with are always read whole "
        "and checked)",
    )
    decoding = parser.add_argument_group("decoding (every request)")
    add_decoding_flags(decoding, SERVED)
    decoding.add_argument(
        "--shared-lookup",
        action="store_true",
        help="lookup also proposes what earlier requests' outputs continued with (outputs never change; only their "
        "speed can tell that another request produced the same text)",
    )
    ray = parser.add_argument_group("Ray Serve (needs the ray extra)")
    ray.add_argument("--ray", action="store_true", help="deploy on Ray Serve: --replicas Ray replicas, one model each")
    ray.add_argument("--ray-address", metavar="ADDR", help="a Ray cluster to join (default: RAY_ADDRESS, else local)")
    ray.add_argument(
        "--num-cpus", type=float, metavar="N", help=f"Ray CPUs per replica (default {ray_default('num_cpus')})"
    )
    ray.add_argument(
        "--num-gpus", type=float, metavar="N", help=f"Ray GPUs per replica (default {ray_default('num_gpus')})"
    )
    ray.add_argument(
        "--autoscaling",
        type=json_object,
        metavar="JSON",
        help='Ray Serve autoscaling_config, e.g. \'{"min_replicas": 1, "max_replicas": 4}\' (replaces --replicas)',
    )
    ray.add_argument(
        "--max-ongoing-requests",
        type=positive_int,
        metavar="N",
        help="requests Ray sends one replica at once (default: twice what it holds)",
    )
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    return parser


def given(**fields) -> dict:
    """The fields that were given (None: left to the config's default)."""
    return {k: v for k, v in fields.items() if v is not None}


def configs_of(args: argparse.Namespace):
    """(ServeConfig, RayConfig or None) from the flags; every default is the configs' own."""
    from paradecode.runtime.config import GenerationConfig
    from paradecode.runtime.decoding_flags import SERVED, decoding_fields
    from paradecode.runtime.serve.config import RayConfig, ServeConfig

    generation = GenerationConfig(
        **decoding_fields(args, SERVED), **given(lookup_shared=True if args.shared_lookup else None)
    )
    preparing = args.max_preparing_bytes
    if preparing is None and args.max_body_bytes is not None:  # room for the largest body allowed, as before
        preparing = max(ServeConfig.max_preparing_bytes, args.max_body_bytes)
    config = ServeConfig(
        args.export,
        **given(
            served_model_name=args.served_model_name,
            host=args.host,
            port=args.port,
            replicas=None if args.ray else args.replicas,
            max_batch=args.max_batch,
            prefill_tokens=args.prefill_tokens,
            max_queue=args.max_queue,
            request_timeout=args.request_timeout,
            read_timeout=args.read_timeout,
            shutdown_timeout=args.shutdown_timeout,
            max_body_bytes=args.max_body_bytes,
            max_preparing_bytes=preparing,
            backend=args.backend,
            device=args.device,
            lanes=args.lanes,
            threads=args.threads,
            torch_compile=args.compile or None,
        ),
        verify=not args.no_verify,
        generation=generation,
    )
    ray_flags = given(
        address=args.ray_address,
        num_cpus=args.num_cpus,
        num_gpus=args.num_gpus,
        autoscaling=args.autoscaling,
        max_ongoing_requests=args.max_ongoing_requests,
    )
    if not args.ray:
        if ray_flags:
            raise UserInputError(f"{', '.join('--' + k.replace('_', '-') for k in ray_flags)} need --ray.")
        return config, None
    return config, RayConfig(**given(replicas=args.replicas), **ray_flags)


def http_server(service):
    """The uvicorn server of `service`: the app, the h11 protocol with its head deadline, and a shutdown that
    answers every open request (runtime/serve/shutdown.py). Run it with `server.run(sockets=[socket])`."""
    import uvicorn

    from paradecode.runtime.serve.app import build_app
    from paradecode.runtime.serve.protocol import head_timed
    from paradecode.runtime.serve.shutdown import GracefulServer, graceful_timeout

    config = service.config
    return GracefulServer(
        uvicorn.Config(
            build_app(service),
            http=head_timed(config.read_timeout),
            timeout_keep_alive=min(5.0, config.read_timeout),  # seconds a kept-alive connection may idle
            timeout_graceful_shutdown=graceful_timeout(config.shutdown_timeout),
            log_config=None,  # our handlers (main) print uvicorn's records too
        ),
        service,
        config.shutdown_timeout,
    )


def serve(config) -> None:
    """Load the replicas, serve until SIGTERM or Ctrl-C, answer what is in flight, free the replicas."""
    try:
        import uvicorn  # noqa: F401 (the serve extra)
    except ImportError as err:
        raise MissingDependencyError(f"{PROG} needs the serve extra: `pip install paradecode[serve]` ({err}).") from err
    from paradecode.runtime.serve.protocol import listening_socket
    from paradecode.runtime.serve.service import Service

    sock = listening_socket(config.host, config.port)  # a bad --host or a taken --port is refused before loading
    try:
        with Service(config) as service:
            server = http_server(service)
            host, port = sock.getsockname()[:2]
            logger.info("serving %s on http://%s:%d", config.served_model_name, host, port)
            # uvicorn takes SIGTERM and SIGINT while it runs: it stops accepting, lets in-flight requests finish
            # (answering what is left after --shutdown-timeout), then raises the signal again for run_command.
            with signals_stop(server):
                server.run(sockets=[sock])
    finally:
        sock.close()


@contextmanager
def signals_stop(server):
    """Around `server.run`: a SIGINT or SIGTERM before uvicorn takes the signals (its event loop starting) or after
    it gives them back stops the server as uvicorn's own handling does, and is raised again for run_command once the
    server has returned. Without it the interrupt broke into asyncio's start (the server's coroutine never awaited,
    its task destroyed pending: stderr noise after "stopped", seen on a loaded 2-core machine)."""
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread alone
        yield
        return
    caught: list[int] = []

    def stop(signum, frame) -> None:
        caught.append(signum)
        server.should_exit = True

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if caught:
        signal.raise_signal(caught[0])


def main(argv: list[str] | None = None) -> int:
    def work():  # all of it under run_command, so a Ctrl-C at any moment ends with "stopped" and 130
        args = build_parser().parse_args(argv)
        logging.basicConfig(
            level=args.log_level.upper(), format=f"%(asctime)s {PROG}: %(levelname)s %(name)s: %(message)s"
        )
        config, ray_config = configs_of(args)
        if ray_config is None:
            serve(config)
        else:
            from paradecode.runtime.serve.ray_serve import run

            run(config, ray_config)

    # uvicorn (and Ray) stop on SIGINT even where it was inherited as ignored: so it is an interrupt here too
    code, _ = run_command(PROG, work, interrupted="stopped", take_ignored=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
