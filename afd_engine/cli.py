"""The `afd` command: one subcommand per job. User errors print one line and exit 2."""

from __future__ import annotations

import argparse
import sys
import time

from afd_engine.errors import AFDError

DEMO_PROMPTS = (
    "The quick brown fox",
    "Attention and experts run on separate machines because",
    "Once upon a time",
    "def fibonacci(n):",
)


def _generate(ns: argparse.Namespace) -> int:
    from afd_engine import Engine, EngineArgs, SamplingParams

    params = SamplingParams(max_new_tokens=ns.max_new_tokens, temperature=ns.temperature, top_p=ns.top_p,
                            top_k=ns.top_k, seed=ns.sample_seed, stop=tuple(ns.stop or ()), ignore_eos=ns.ignore_eos)
    with Engine(EngineArgs.from_cli(ns)) as engine:
        out = engine.generate(prompts=ns.prompt, sampling_params=params)
    for prompt, o in zip(ns.prompt, out):
        if o.error:
            print(f"error: {o.error}", file=sys.stderr)
            return 2
        print(o.text if len(ns.prompt) == 1 else f"{prompt!r} -> {o.text!r} ({o.finish_reason})")
    return 0


def _demo(ns: argparse.Namespace) -> int:
    """Offline generation on the embedded tiny model (random weights: the text is noise)."""
    from afd_engine import Engine, EngineArgs, SamplingParams
    from afd_engine.default_model import DEFAULT_MODEL_NAME

    args = EngineArgs.from_cli(ns)
    with Engine(args) as engine:
        print(f"model: {engine.model_path} ({DEFAULT_MODEL_NAME if not args.model_path else 'user checkpoint'}; "
              f"{engine.config.architecture}, random weights if tiny)")
        start = time.perf_counter()
        outs = engine.generate(prompts=list(DEMO_PROMPTS), use_tqdm=True,
                               sampling_params=SamplingParams(max_new_tokens=ns.max_new_tokens, temperature=0.0))
        elapsed = time.perf_counter() - start
    for prompt, o in zip(DEMO_PROMPTS, outs):
        print(f"{prompt!r} -> {o.token_ids[:12]}... {o.finish_reason}")
    n = sum(len(o.token_ids) for o in outs)
    print(f"{len(outs)} requests, {n} tokens in {elapsed:.2f} s ({n / elapsed:.1f} tok/s)")
    return 0


def _serve(ns: argparse.Namespace) -> int:
    from afd_engine import EngineArgs
    from afd_engine.server.launch import ServerArgs, serve

    server = ServerArgs(host=ns.host, port=ns.port, api_key=ns.api_key, served_model_name=ns.served_model_name,
                        default_max_tokens=ns.default_max_tokens)
    return serve(EngineArgs.from_cli(ns), server)


def _make_tiny(ns: argparse.Namespace, rest: list[str]) -> int:
    from afd_engine.tiny_model import main_make_tiny_model

    return main_make_tiny_model(rest)


def build_parser() -> argparse.ArgumentParser:
    from afd_engine.engine_args import EngineArgs
    from afd_engine.sampling_params import SamplingParams
    from afd_engine.server.launch import ServerArgs

    parser = argparse.ArgumentParser(prog="afd", description="AFD inference engine for MoE LLMs")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion offline and print it")
    gen.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for several)")
    defaults = SamplingParams()  # one source of defaults for the Python API and the CLI
    gen.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    gen.add_argument("--temperature", type=float, default=defaults.temperature, help="0 is greedy")
    gen.add_argument("--top-p", type=float, default=defaults.top_p)
    gen.add_argument("--top-k", type=int, default=defaults.top_k)
    gen.add_argument("--sample-seed", type=int, default=defaults.seed, help="seed of the sampled request")
    gen.add_argument("--stop", action="append", help="stop string (repeat for several)")
    gen.add_argument("--ignore-eos", action="store_true")
    EngineArgs.add_cli_args(gen)

    srv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    srv_defaults = ServerArgs()
    srv.add_argument("--host", default=srv_defaults.host, help="address to bind (default: loopback only)")
    srv.add_argument("--port", type=int, default=srv_defaults.port)
    srv.add_argument("--api-key", default=srv_defaults.api_key, help="require this bearer token on /v1 routes")
    srv.add_argument("--served-model-name", default=srv_defaults.served_model_name,
                     help="model name in the API (default: the checkpoint directory's name)")
    srv.add_argument("--default-max-tokens", type=int, default=srv_defaults.default_max_tokens,
                     help="completion length when a request sets none")
    EngineArgs.add_cli_args(srv)

    demo = sub.add_parser("demo", help="offline generation demo on the embedded tiny model")
    demo.add_argument("--max-new-tokens", type=int, default=32)
    EngineArgs.add_cli_args(demo)

    sub.add_parser("make-tiny-model", help="write a small random DeepSeek checkpoint (see its --help)",
                   add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["make-tiny-model"]:
        return _make_tiny(None, argv[1:])
    ns = build_parser().parse_args(argv)
    try:
        return {"generate": _generate, "demo": _demo, "serve": _serve}[ns.command](ns)
    except AFDError as exc:
        print(f"afd {ns.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
