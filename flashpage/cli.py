"""The `flashpage` command: generate and chat (serve and bench join as their issues land)."""

from __future__ import annotations

import argparse
import sys

from flashpage.loader.default_model import DEFAULT_MODEL


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model directory, .gguf file, or known name (default {DEFAULT_MODEL})")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"], help="dummy: random weights of the model's shape")
    p.add_argument("--device", default="auto", help="cpu, cuda, or auto (cuda when available)")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"],
                   help="auto: triton on CUDA, torch (PyTorch reference) on CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (the default); try 0.7 to sample")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flashpage", description="Fast LLM inference for Llama-family models.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete a prompt, streaming the text")
    gen.add_argument("prompt")
    _add_model_args(gen)
    chat = sub.add_parser("chat", help="answer one chat message with the model's chat template, streaming the reply")
    chat.add_argument("message")
    chat.add_argument("--system", default=None, help="an optional system message")
    _add_model_args(chat)
    bench = sub.add_parser("bench", help="benchmarks (need a CUDA GPU)")
    bench.add_argument("suite", choices=["kernels"])
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="options of the suite (see --help of the suite)")
    args = parser.parse_args(argv)
    if args.command == "bench":
        from flashpage.bench.kernels import main as bench_kernels

        return bench_kernels(args.rest)

    try:
        from flashpage import LLM, SamplingParams

        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed)
        llm = LLM(args.model, dtype=args.dtype, device=args.device, seed=args.seed, load_format=args.load_format,
                  max_model_len=args.max_model_len, attention_backend=args.attention_backend)
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


if __name__ == "__main__":
    sys.exit(main())
