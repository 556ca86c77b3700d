"""The `flashpage` command: generate, chat, serve, bench."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import signal
import sys
import threading

from flashpage.engine.config import EngineConfig


def _llm(args):
    from flashpage import LLM

    return LLM(**dataclasses.asdict(EngineConfig.from_cli(args)))


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (the default); try 0.7 to sample")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The `flashpage` parser and its subcommands' parsers by name."""
    parser = argparse.ArgumentParser(prog="flashpage", description="Fast LLM inference for Llama-family models.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete a prompt, streaming the text")
    gen.add_argument("prompt")
    EngineConfig.add_cli_arguments(gen)
    _add_sampling_args(gen)
    chat = sub.add_parser("chat", help="answer one chat message with the model's chat template, streaming the reply")
    chat.add_argument("message")
    chat.add_argument("--system", default=None, help="an optional system message")
    EngineConfig.add_cli_arguments(chat)
    _add_sampling_args(chat)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    # (half the offline token budget, as vLLM's server: a prefill chunk stalls the requests decoding beside it)
    EngineConfig.add_cli_arguments(serve, max_num_batched_tokens=8192)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    serve.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    serve.add_argument("--max-waiting", type=int, default=1024, help="waiting requests beyond this get 503")
    serve.add_argument("--shutdown-timeout", type=float, default=5.0,
                       help="on SIGTERM, seconds running requests may still run before they are aborted (default 5)")
    bench = sub.add_parser("bench", help="benchmarks: kernels, fused, latency, throughput, deterministic (CUDA GPU); "
                                         "serve (a running server); cpu (flashpage vs transformers on this CPU); spec "
                                         "(speculative decoding against none); structured (structured outputs' cost); "
                                         "quality (what the lossy modes cost, on this CPU); tp (tensor parallelism's "
                                         "correctness and all-reduce rate, several GPUs); host (the engine's host "
                                         "work per step, the model left out)")
    bench.add_argument("suite", choices=["kernels", "fused", "latency", "throughput", "serve", "cpu", "spec",
                                         "structured", "deterministic", "quality", "tp", "host"])
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="options of the suite (see --help of the suite)")
    return parser, {"generate": gen, "chat": chat, "serve": serve, "bench": bench}


def main(argv: list[str] | None = None) -> int:
    args = build_parser()[0].parse_args(argv)
    if args.command == "bench":
        try:
            module = importlib.import_module(f"flashpage.bench.{args.suite}")
        except ModuleNotFoundError as e:
            print(f"flashpage: error: bench {args.suite} needs the package {e.name!r} (pip install it; the GPU "
                  f"suites take 'flashpage[triton]' on a machine with a CUDA GPU)", file=sys.stderr)
            return 2
        return module.main(args.rest)
    if args.command == "serve":
        return _serve(args)

    try:
        from flashpage import SamplingParams

        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed)
        llm = _llm(args)
        if args.command == "chat":
            messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
                {"role": "user", "content": args.message}]
            prompt = {"prompt_token_ids": llm.chat_prompt_ids(messages)}
        else:
            prompt = args.prompt
        for piece in llm.stream(prompt, params):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
    except (ValueError, RuntimeError, OSError) as e:
        print(f"flashpage: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


def _serve(args) -> int:
    try:
        import uvicorn

        from flashpage.parallel.workers import is_worker_rank
        from flashpage.server.app import build_app
        from flashpage.server.async_engine import AsyncEngine
        from flashpage.server.engine_core import EngineProcess

        if is_worker_rank():  # under torchrun: this rank's worker loop runs in the engine's constructor, which
            _llm(args)  # exits with rank 0 (the server is rank 0's)
            return 0
        core = EngineProcess(dataclasses.asdict(EngineConfig.from_cli(args)))  # (returns once the model is loaded)
        engine = AsyncEngine(core, max_waiting=args.max_waiting, start=False)
        app = build_app(engine, core.tokenizer, args.served_model_name or args.model, api_key=args.api_key)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"flashpage: error: {e}", file=sys.stderr)
        return 2
    grace = args.shutdown_timeout
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                                           timeout_graceful_shutdown=grace + 10))

    def stop(*_):
        # uvicorn stops accepting and then waits for open responses; the engine refuses new requests, lets the
        # running ones go on for `grace` seconds and then aborts them, which ends every open stream. A second
        # signal stops at once.
        server.force_exit = server.should_exit
        server.should_exit = True
        engine.shutdown(grace, wait=False)

    def serve_http():
        try:
            server.run()  # (off the main thread uvicorn leaves the signals to us)
        finally:
            engine.shutdown(0, wait=False)  # the HTTP side ended (or never started): so does the engine

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    engine.on_failure = lambda e: setattr(server, "should_exit", True)  # requests got 503s; the server exits 1
    http = threading.Thread(target=serve_http, name="flashpage-http")
    http.start()
    engine.run()  # relays the engine process's outputs until it stops
    http.join()
    core.join(10)
    if engine.failed:
        print(f"flashpage: error: {engine.failed}", file=sys.stderr)
        return 1
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
