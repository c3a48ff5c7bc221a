"""The `afd` command: one subcommand per job. User errors print one line and exit 2."""

from __future__ import annotations

import argparse
import os
import sys
import time

from afd_engine.errors import AFDError, ConfigError

DEMO_PROMPTS = (
    "The quick brown fox",
    "Attention and experts run on separate machines because",
    "Once upon a time",
    "def fibonacci(n):",
)


def _generate(ns: argparse.Namespace) -> int:
    from afd_engine import EngineArgs, SamplingParams, make_engine

    params = SamplingParams(
        max_new_tokens=ns.max_new_tokens,
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        seed=ns.sample_seed,
        stop=tuple(ns.stop or ()),
        ignore_eos=ns.ignore_eos,
    )
    with make_engine(EngineArgs.from_cli(ns)) as engine:
        out = engine.generate(prompts=ns.prompt, sampling_params=params)
    for prompt, o in zip(ns.prompt, out):
        if o.error:
            print(f"error: {o.error}", file=sys.stderr)
            return 2
        print(o.text if len(ns.prompt) == 1 else f"{prompt!r} -> {o.text!r} ({o.finish_reason})")
    return 0


def _demo(ns: argparse.Namespace) -> int:
    """Offline generation on the embedded model (trained on Python's documentation, tiny)."""
    from afd_engine import EngineArgs, SamplingParams, make_engine
    from afd_engine.default_model import DEFAULT_MODEL_NAME
    from afd_engine.model_config import ModelConfig

    args = EngineArgs.from_cli(ns)
    with make_engine(args) as engine:
        print(
            f"model: {engine.model_path} ({DEFAULT_MODEL_NAME if not args.model_path else 'user checkpoint'}; "
            f"{ModelConfig.from_pretrained(engine.model_path).architecture})"
        )
        start = time.perf_counter()
        outs = engine.generate(
            prompts=list(DEMO_PROMPTS),
            use_tqdm=True,
            sampling_params=SamplingParams(max_new_tokens=ns.max_new_tokens, temperature=0.0),
        )
        elapsed = time.perf_counter() - start
    for prompt, o in zip(DEMO_PROMPTS, outs):
        print(f"{prompt!r} -> {o.text[:80]!r} ({len(o.token_ids)} tokens, {o.finish_reason})")
    n = sum(len(o.token_ids) for o in outs)
    print(f"{len(outs)} requests, {n} tokens in {elapsed:.2f} s ({n / elapsed:.1f} tok/s)")
    return 0


def _serve(ns: argparse.Namespace) -> int:
    from afd_engine import EngineArgs
    from afd_engine.server.serve import ServerArgs, serve

    if ns.pd:
        from afd_engine.server.pd_serve import serve_pd

        return serve_pd(ns.argv[1:], ns)

    args = EngineArgs.from_cli(ns)
    _pd_secret(ns, args)
    return serve(args, ServerArgs.from_cli(ns))


def _launch(ns: argparse.Namespace) -> int:
    """One role of a deployment spread over machines; peers meet at --dist-init-addr."""
    import logging

    from afd_engine import EngineArgs
    from afd_engine.processes.deployment import Deployment
    from afd_engine.processes.rendezvous import RendezvousSpec, local_ip_towards
    from afd_engine.server.serve import ServerArgs, serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = EngineArgs.from_cli(ns)
    if ns.nnodes is not None and ns.nnodes != 1 + args.ffn_nodes:
        raise ConfigError(
            f"--nnodes={ns.nnodes} but one attention machine + --ffn-nodes={args.ffn_nodes} "
            f"makes {1 + args.ffn_nodes}; make them agree"
        )
    if not 0 <= ns.node_rank < args.ffn_nodes:
        raise ConfigError(f"--node-rank={ns.node_rank} must be in [0, --ffn-nodes={args.ffn_nodes})")
    host_ip = ns.host_ip or local_ip_towards(ns.dist_init_addr)
    keys = _cluster_keys(ns, args.transport)
    _pd_secret(ns, args)
    rdv = RendezvousSpec(ns.dist_init_addr, host_ip, ns.rendezvous_timeout, keys)
    deployment = Deployment(args, role=ns.role, node_rank=ns.node_rank, rendezvous=rdv)
    if ns.role == "attention":
        return serve(args, ServerArgs.from_cli(ns), deployment)
    try:
        deployment.start()
        return deployment.wait()
    finally:
        deployment.stop()


def _cluster_keys(ns: argparse.Namespace, transport: str):
    """The deployment's cluster keys (--cluster-secret, else AFD_CLUSTER_SECRET). Required when the
    rendezvous is not on this machine's loopback, unless --insecure-cluster says the network is private."""
    from comm.auth import ENV, cluster_keys, is_loopback

    try:
        keys = cluster_keys(ns.cluster_secret)
    except ValueError as exc:
        raise ConfigError(f"--cluster-secret: {exc}") from None
    across = not is_loopback(ns.dist_init_addr)
    if across and keys is None and not ns.insecure_cluster:
        raise ConfigError(
            f"--dist-init-addr={ns.dist_init_addr} is reached over the network: give every role the same "
            f"secret in {ENV} (or --cluster-secret, which `ps` shows), so that the rendezvous and the data "
            "plane admit only the deployment's ranks; --insecure-cluster runs without it (a private network only)"
        )
    if across and keys is not None and transport == "torch" and not ns.insecure_cluster:
        raise ConfigError(
            "--transport torch between machines is not authenticated (gloo and NCCL admit any peer): use "
            "--transport auto or zmq with the cluster secret, or --insecure-cluster on a private network"
        )
    return keys


def _pd_secret(ns: argparse.Namespace, args) -> None:
    """A prefill or decode instance's cluster secret: its KV message and bootstrap ports then admit
    only holders of it (ZeroMQ CURVE). Required when --disaggregation-host is not loopback (the
    instances are on different machines), unless --insecure-cluster; it reaches this instance's
    processes in their environment, never their command lines."""
    if args.disaggregation_mode == "null":
        return
    from comm.auth import ENV, cluster_keys, is_loopback

    try:
        keys = cluster_keys(ns.cluster_secret)
    except ValueError as exc:
        raise ConfigError(f"--cluster-secret: {exc}") from None
    across = not is_loopback(f"{args.disaggregation_host}:0")
    if across and keys is None and not ns.insecure_cluster:
        raise ConfigError(
            f"--disaggregation-host {args.disaggregation_host} is reached over the network: give the prefill and "
            f"decode instances the same secret in {ENV} (or --cluster-secret, which `ps` shows), so that their KV "
            "and bootstrap ports admit only each other; --insecure-cluster runs without it (a private network only)"
        )
    if across and keys is not None and args.disaggregation_transfer_backend == "mooncake" and not ns.insecure_cluster:
        raise ConfigError(
            "--disaggregation-transfer-backend mooncake between machines is not authenticated (the Mooncake "
            "Transfer Engine admits any peer): use builtin with the cluster secret, or --insecure-cluster on a "
            "private network"
        )
    if keys is not None:
        os.environ[ENV] = keys.secret.decode()


def _secret_args(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--cluster-secret",
        default=None,
        help=f"a shared secret (16+ characters) every {what} must have: the ports between machines admit only its "
        "holders (ZeroMQ CURVE). Prefer AFD_CLUSTER_SECRET: `ps` shows flags",
    )
    parser.add_argument(
        "--insecure-cluster",
        action="store_true",
        help="run across machines without the cluster secret (the ports must be on a private network)",
    )


def _expert_load(ns: argparse.Namespace) -> int:
    """Fetches GET /expert_load from a running server; prints the expert ranks' loads, writes JSON."""
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(ns.url.rstrip("/") + "/expert_load")
    if ns.api_key:
        req.add_header("Authorization", f"Bearer {ns.api_key}")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            report = json.loads(resp.read())
    except (urllib.error.URLError, OSError) as exc:
        raise AFDError(f"cannot read {req.full_url}: {exc}") from None
    if ns.output:
        with open(ns.output, "w") as f:
            json.dump(report, f)
    loads = ", ".join(f"{x:g}" for x in report["expert_rank_load"])
    print(
        f"placement {report['placement']['version']}, {report['steps']} steps, window {report['window_steps']}: "
        f"expert rank loads [{loads}], imbalance {report['imbalance']:.3f}"
    )
    return 0


def _make_tiny(ns: argparse.Namespace, rest: list[str]) -> int:
    from afd_engine.tiny_model import main_make_tiny_model

    return main_make_tiny_model(rest)


def _train_tiny(rest: list[str]) -> int:
    from afd_engine.train_tiny import main_train_tiny

    return main_train_tiny(rest)


def build_parser() -> argparse.ArgumentParser:
    from afd_engine.arg_errors import ArgumentParser
    from afd_engine.engine_args import EngineArgs
    from afd_engine.sampling_params import SamplingParams
    from afd_engine.server.serve import ServerArgs

    parser = ArgumentParser(prog="afd", description="AFD inference engine for MoE LLMs")
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

    srv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API (any mode, all ranks on this machine)")
    ServerArgs.add_cli_args(srv)
    srv.add_argument(
        "--pd",
        action="store_true",
        help="start a prefill instance, a decode instance and `afd router` (on --port) on this machine",
    )
    modes = ("single", "colocated", "afd")
    srv.add_argument("--prefill-mode", default="single", choices=modes, help="--pd: the prefill instance's --mode")
    srv.add_argument("--decode-mode", default="single", choices=modes, help="--pd: the decode instance's --mode")
    srv.add_argument("--prefill-args", default="", help="--pd: flags for the prefill instance only (one string)")
    srv.add_argument("--decode-args", default="", help="--pd: flags for the decode instance only (one string)")
    srv.add_argument(
        "--local-prefill-max-tokens",
        type=int,
        default=0,
        help="--pd: prompts of at most this many tokens skip the prefill instance (the decode instance prefills them)",
    )

    _secret_args(srv, "prefill and decode instance")

    from afd_engine.server.pd_router import add_router_args

    add_router_args(
        sub.add_parser(
            "router", help="the OpenAI-compatible front of a prefill-decode deployment (instances started apart)"
        )
    )

    launch = sub.add_parser(
        "launch", help="start one role (attention, or the FFN ranks of one FFN node) of a multi-machine AFD deployment"
    )
    launch.add_argument("--role", required=True, choices=("attention", "ffn"))
    launch.add_argument("--node-rank", type=int, default=0, help="ffn: which FFN node this machine is")
    launch.add_argument(
        "--nnodes",
        type=int,
        default=None,
        help="machines in the deployment, as a check (one attention machine + --ffn-nodes)",
    )
    launch.add_argument("--dist-init-addr", required=True, help="HOST:PORT of the rendezvous (the attention node)")
    launch.add_argument(
        "--host-ip",
        default=None,
        help="address peers reach this machine at (default: the route towards --dist-init-addr)",
    )
    launch.add_argument("--rendezvous-timeout", type=float, default=300.0, help="seconds to wait for all ranks")
    _secret_args(launch, "role (and prefill/decode instance)")
    ServerArgs.add_cli_args(launch)

    demo = sub.add_parser("demo", help="offline generation demo on the embedded tiny model")
    demo.add_argument("--max-new-tokens", type=int, default=32)

    load = sub.add_parser(
        "expert-load", help="the expert load statistics and placement of a running server (GET /expert_load)"
    )
    load.add_argument("--url", default="http://127.0.0.1:30000", help="the server's base URL")
    load.add_argument("--api-key", default=None, help="the server's --api-key, if it has one")
    load.add_argument("--output", default=None, help="also write the whole report as JSON to this file")

    for engine_parser in (gen, srv, launch, demo):
        EngineArgs.add_cli_args(engine_parser)
        engine_parser.add_argument("--config", default=None, help="deployment settings from a YAML file (see configs/)")

    sub.add_parser("make-tiny-model", help="write a small random DeepSeek checkpoint (see its --help)", add_help=False)
    sub.add_parser(
        "train-tiny", help="train the small default model on Python's documentation (see its --help)", add_help=False
    )
    sub.add_parser(
        "plan",
        help="performance model: deploy | model | comm | sparsity | reference | calibrate | simulate (see its --help)",
        add_help=False,
    )
    return parser


def _defaults(parser: argparse.ArgumentParser, command: str) -> dict:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return {a.dest: a.default for a in sub._actions}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["make-tiny-model"]:
        return _make_tiny(None, argv[1:])
    if argv[:1] == ["train-tiny"]:
        return _train_tiny(argv[1:])
    if argv[:1] == ["router"]:  # (before the engine's parser: the router needs no torch)
        from afd_engine.server.pd_router import main as router_main

        return router_main(argv[1:])
    if argv[:1] == ["plan"]:
        from afd_engine.planner.cli import main as plan_main

        return plan_main(argv[1:])
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        from afd_engine.deploy_config import apply_config

        if ns.command == "expert-load":
            return _expert_load(ns)
        apply_config(ns, _defaults(parser, ns.command))
        ns.argv = argv  # (afd serve --pd passes the command line on to its instances)
        return {"generate": _generate, "demo": _demo, "serve": _serve, "launch": _launch}[ns.command](ns)
    except AFDError as exc:
        print(f"afd {ns.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
