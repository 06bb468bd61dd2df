"""The `atom-ray` command: `serve` runs the OpenAI-compatible server on Ray (a local one by default);
`generate` streams one completion to the terminal without Ray; `kernels` prints which kernel runs each op
for a model on this machine (no weights loaded)."""
from __future__ import annotations

import argparse
import sys

from atom_ray.engine_args import add_engine_arguments, engine_kwargs_from_args

DEFAULT_MODEL = "smollm2-135m"


def _sampling_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=128)
    group.add_argument("--temperature", type=float, default=0.0)
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="atom-ray", description="LLM inference on Ray (ATOM-style engine).")
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="generate one completion, streamed to the terminal")
    generate.add_argument("--model", default=DEFAULT_MODEL, help=f"HF folder, .gguf file or alias (default {DEFAULT_MODEL})")
    generate.add_argument("--prompt", required=True)
    generate.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    _sampling_arguments(generate)
    add_engine_arguments(generate)
    generate.set_defaults(handler=run_generate)

    serve = commands.add_parser("serve", help="serve an OpenAI-compatible API on Ray Serve")
    serve.add_argument("--model", default=DEFAULT_MODEL, help=f"HF folder, .gguf file or alias (default {DEFAULT_MODEL})")
    serve.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--address", default=None, help="Ray cluster to join ('auto': the one running here); "
                       "default: start a local Ray on 127.0.0.1")
    serve.add_argument("--config", default=None, help="a serve config file (applications, http_options)")
    serve.add_argument("--dashboard", action="store_true",
                       help="start Ray's dashboard with a local Ray (127.0.0.1:8265, behind Ray's token; about "
                       "1 GB more memory): `serve status` and `serve shutdown` need it")
    serve.add_argument("--cpus-per-rank", type=int, default=None)
    serve.add_argument("--gpus-per-rank", type=float, default=1.0,
                       help="GPU share of each TP rank; 0.5 puts two ranks on a GPU (to check TP numerics; slow)")
    serve.add_argument("--max-pending-sequences", type=int, default=256,
                       help="sequences (prompts x n) in flight at once; more get 429 (default 256)")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer <key>' on every /v1/ route (default: the "
                       "ATOM_RAY_API_KEY environment variable; none: no key)")
    serve.add_argument("--tool-call-parser", default="auto",
                       help="how chat completions read tool calls (tool_choice auto) from the model's text: vLLM's "
                       "parser names (hermes, llama3_json, qwen3_coder, deepseek_v3, deepseek_v31, deepseek_v32, "
                       "kimi_k2, glm45, glm47, minimax_m2, openai); auto: the model's own (default); none: off")
    serve.add_argument("--reasoning-parser", default="auto",
                       help="how chat completions split reasoning_content from the answer: deepseek_r1, "
                       "deepseek_v3, qwen3, glm45, minimax_m2, kimi_k2, openai; auto: the model's own (default); "
                       "none: off")
    add_engine_arguments(serve)
    serve.set_defaults(handler=run_serve)

    kernels = commands.add_parser("kernels", help="print the kernel table (op -> implementation, fallbacks with "
                                  "their reasons) a model would run with on this machine")
    kernels.add_argument("--model", default=DEFAULT_MODEL, help=f"HF folder, .gguf file or alias (default {DEFAULT_MODEL})")
    add_engine_arguments(kernels)
    kernels.set_defaults(handler=run_kernels)

    bundle = commands.add_parser("bundle", help="build an offline archive of Ray, Serve and atom-ray for a GPU "
                                 "host without network access")
    bundle.add_argument("--out", default="atom-ray-bundle.tar.xz")
    bundle.add_argument("--python-version", default="3.12", help="the host's Python (default 3.12)")
    bundle.add_argument("--grpcio-version", required=True, help="the host's grpcio version (pip show grpcio)")
    bundle.add_argument("--extra", action="append", default=[], help="another requirement to include")
    bundle.add_argument("--without-project", action="store_true", help="leave atom-ray's own packages out")
    bundle.set_defaults(handler=run_bundle)
    return parser


def run_bundle(args: argparse.Namespace) -> int:
    from pathlib import Path

    from atom_ray.offline_bundle import build_bundle
    out = build_bundle(Path(args.out), args.python_version, args.grpcio_version, args.extra, not args.without_project)
    print(f"{out} ({out.stat().st_size / 2**20:.1f} MiB). On the host: mkdir -p /opt/atom-ray && "
          f"tar -xJf {out.name} -C /opt/atom-ray && export PYTHONPATH=/opt/atom-ray:$PYTHONPATH")
    return 0


def run_kernels(args: argparse.Namespace) -> int:
    from engine import EngineConfig, kernels
    from engine.loader import resolve_model
    from engine.runner.device import resolve_device, resolve_dtype
    from engine.runner.model_facts import format_op_table, model_facts
    config = EngineConfig.from_kwargs(args.model, **engine_kwargs_from_args(args))
    source = resolve_model(config.model, config.load_format, config.hf_overrides)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, source.hf_config, device)
    backend = kernels.registry.resolve(config.kernel_backend, device, model_facts(source.hf_config, config, dtype))
    print(f"kernel backend {backend.name} on {device} for {args.model} ({dtype}):")
    print(format_op_table(backend))
    return 0


def run_serve(args: argparse.Namespace) -> int:
    from atom_ray.serving import ServeOptions, serve_until_interrupted
    options = ServeOptions(host=args.host, port=args.port, address=args.address, config_path=args.config,
                           dashboard=args.dashboard)
    app_args = {"model": args.model, "served_model_name": args.served_model_name,
                "engine_args": engine_kwargs_from_args(args), "cpus_per_rank": args.cpus_per_rank,
                "gpus_per_rank": args.gpus_per_rank, "max_pending_sequences": args.max_pending_sequences,
                "api_key": args.api_key, "tool_call_parser": args.tool_call_parser,
                "reasoning_parser": args.reasoning_parser}
    return serve_until_interrupted(options, app_args)


def run_generate(args: argparse.Namespace) -> int:
    from engine import LLMEngine, EngineConfig, SamplingParams
    engine = LLMEngine(EngineConfig.from_kwargs(args.model, **engine_kwargs_from_args(args)))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sampling_seed, stop=args.stop)
    prompt = args.prompt
    if args.chat:
        prompt = engine.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    engine.add_request("cli", prompt, params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            sys.stdout.write(output.outputs[0].new_text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except ValueError as exc:  # every user-caused error (config, model folder, request) is a ValueError
        print(f"atom-ray: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
