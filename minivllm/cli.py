"""The `minivllm` command: `serve [MODEL]` runs the OpenAI-compatible server; `generate` and `chat`
run one prompt through the offline `LLM` API and print the result. Engine flags use vLLM's names.
"""
from __future__ import annotations

import argparse
import json
import logging
import re
import shlex
import sys

from minivllm import envs
from minivllm.config import EngineConfig
from minivllm.core.scheduler import SchedulerConfig
from minivllm.server.tool_parsers import TOOL_PARSERS

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from '1073741824', '512MiB', '2G', '1.5GB' (binary units; vLLM's --kv-cache-memory takes bytes)."""
    match = _SIZE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use bytes or e.g. 512MiB, 4GiB)")
    number, unit = float(match.group(1)), match.group(2).lower()
    return int(number * 1024 ** " kmgt".index(unit or " "))


def parse_json_object(text: str) -> dict:
    """A JSON object (vLLM's dict-valued flags, such as --speculative-config)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {text!r} ({error})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r} (e.g. '{{\"method\": \"ngram\"}}')")
    return value


def add_engine_args(parser: argparse.ArgumentParser, serving: bool = False) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder or id (default: the model's)")
    g.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"])
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16", "half", "float"])
    g.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--kv-cache-memory", type=parse_size, default=None,
                   help="bytes for the KV cache (e.g. 64MiB); on CPU the default is small, on GPU it overrides "
                        "--gpu-memory-utilization")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None)
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    g.add_argument("--max-num-waiting", type=int, default=None,
                   help="reject requests with HTTP 429 while this many are waiting (default: no limit)")
    g.add_argument("--small-batch-prefill-tokens", type=int, default=512 if serving else None,
                   help=f"while at most {SchedulerConfig.small_batch_max_seqs} sequences run, a step computes at "
                        "most this many prompt tokens, so prompts arriving together get first tokens one chunk "
                        f"apart rather than all after the whole batch (chunked prefill only; default: "
                        f"{'512' if serving else 'off'}; 0: off)")
    g.add_argument("--max-itl-ms", type=float, default=None,
                   help="inter-token-latency target: while requests decode, a step takes only as many prompt "
                        "tokens as its measured cost allows within this many ms (chunked prefill; default: off)")
    g.add_argument("--collect-step-times", action="store_true",
                   help="time every step on the device for /metrics' minivllm:step_device_seconds and "
                        "minivllm:step_device_idle_seconds (always on with --max-itl-ms)")
    g.add_argument("--preemption-mode", default=None, choices=["recompute", "swap"],
                   help="swap: long preempted sequences move their KV to CPU memory (default: recompute)")
    g.add_argument("--swap-space", type=float, default=4, help="GiB of CPU memory for swapped KV blocks")
    g.add_argument("--enforce-eager", action="store_true", help="do not capture CUDA graphs")
    g.add_argument("--cuda-graph-max-tokens", type=int, default=4096,
                   help="steps with prompt tokens of up to this many tokens replay CUDA graphs too (0: decode only)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule the next step while the current one runs: more throughput, lower ITL, about "
                        "one step more TTFT for new requests (default: on with CUDA, off on CPU)")
    g.add_argument("--attention-backend", default=None, choices=["torch", "triton"])
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    g.add_argument("--distributed-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="tensor parallelism: a rank that has not finished a step after this long fails the "
                        "engine with an error naming it")
    g.add_argument("--speculative-config", type=parse_json_object, default=None,
                   help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 5}\' or '
                        '\'{"method": "draft_model", "draft_layers": 8}\' or \'{"method": "suffix"}\'')
    g.add_argument("--quantization", "-q", default=None,
                   help="fp8 | int8 (quantize at load) or the checkpoint's format (gptq, awq, compressed-tensors); "
                        "gguf keeps a .gguf file's Q4_0/Q4_1/Q8_0 linears quantized; "
                        "default: config.json's quantization_config")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="fp8: store the KV cache as float8 e4m3 with per-layer scales (about twice the tokens); "
                        "auto: the model's dtype")
    g.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters beside the base model (docs/lora.md)")
    g.add_argument("--max-loras", type=int, default=1, help="adapters that may share a step (device slots)")
    g.add_argument("--max-lora-rank", type=int, default=16)
    g.add_argument("--max-cpu-loras", type=int, default=None, help="adapters kept in host memory (default: max-loras)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    dtype = {"half": "float16", "float": "float32"}.get(args.dtype, args.dtype)
    return EngineConfig(
        model=args.model, tokenizer=args.tokenizer, load_format=args.load_format, dtype=dtype, device=args.device,
        seed=args.seed, max_model_len=args.max_model_len, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        small_batch_prefill_tokens=args.small_batch_prefill_tokens or None, max_itl_ms=args.max_itl_ms,
        collect_step_times=args.collect_step_times,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill, gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory=args.kv_cache_memory, num_gpu_blocks_override=args.num_gpu_blocks_override,
        scheduling_policy=args.scheduling_policy, max_num_waiting=args.max_num_waiting,
        preemption_mode=args.preemption_mode, swap_space=args.swap_space,
        enforce_eager=args.enforce_eager, cuda_graph_max_tokens=args.cuda_graph_max_tokens,
        attention_backend=args.attention_backend,
        async_scheduling=args.async_scheduling, tensor_parallel_size=args.tensor_parallel_size,
        distributed_timeout_s=args.distributed_timeout,
        speculative_config=args.speculative_config, quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype, enable_lora=args.enable_lora, max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras)


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    from minivllm.server.limits import ServerLimits
    d = ServerLimits()
    g = parser.add_argument_group("limits")
    g.add_argument("--api-key-exempt-paths", nargs="*", default=list(d.api_key_exempt_paths),
                   help="paths served without the API key (default: %(default)s)")
    g.add_argument("--max-request-body-bytes", type=parse_size, default=d.max_request_body_bytes,
                   help="larger bodies get HTTP 413 (default: 8MiB)")
    g.add_argument("--max-json-depth", type=int, default=d.max_json_depth, help="deeper JSON bodies get HTTP 400")
    g.add_argument("--h11-max-header-count", type=int, default=d.h11_max_header_count)
    g.add_argument("--h11-max-incomplete-event-size", type=parse_size, default=d.h11_max_incomplete_event_size,
                   help="largest request head (request line and headers) in bytes")
    g.add_argument("--max-tokens-limit", type=int, default=d.max_tokens_limit,
                   help="largest max_tokens a request may ask for, and the default when it asks none")
    g.add_argument("--max-n", type=int, default=d.max_n, help="largest n a request may ask for")
    g.add_argument("--max-queued-tokens", type=int, default=d.max_queued_tokens,
                   help="HTTP 429 while admitted requests reserve this many tokens (prompt + max_tokens x n)")
    g.add_argument("--request-timeout", type=float, default=d.request_timeout,
                   help="seconds a request may run before it is aborted with HTTP 408 (default: none)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds running requests get to finish before they are aborted")


def server_limits_from_args(args: argparse.Namespace):
    from minivllm.server.limits import ServerLimits
    return ServerLimits(
        max_request_body_bytes=args.max_request_body_bytes, max_json_depth=args.max_json_depth,
        h11_max_header_count=args.h11_max_header_count,
        h11_max_incomplete_event_size=args.h11_max_incomplete_event_size, max_tokens_limit=args.max_tokens_limit,
        max_n=args.max_n, max_queued_tokens=args.max_queued_tokens, request_timeout=args.request_timeout,
        api_key_exempt_paths=tuple(args.api_key_exempt_paths))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minivllm", description="A small vLLM-like inference engine.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible server")
    serve.add_argument("model", nargs="?", default=None, help="HF folder, .gguf file or dummy config (default model "
                                                              "when omitted)")
    serve.add_argument("--host", default="0.0.0.0")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=envs.MINIVLLM_API_KEY,
                       help="require 'Authorization: Bearer KEY' (default: $MINIVLLM_API_KEY)")
    serve.add_argument("--served-model-name", nargs="+", default=None,
                       help="model name(s) clients use (default: the model's name)")
    serve.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                       help="how tool calls are found in replies (for tool_choice auto)")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="let the model decide to call tools (tool_choice auto); needs --tool-call-parser")
    serve.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                       help="PEFT adapter folders served as models named NAME (needs --enable-lora)")
    serve.add_argument("--allow-runtime-lora-updating", action="store_true",
                       help="mount POST /v1/load_lora_adapter and /v1/unload_lora_adapter")
    serve.add_argument("--uvicorn-log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug", "trace"])
    serve.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                       help="engine replicas, each its own server process, behind one router on --port")
    add_limit_args(serve)
    add_engine_args(serve, serving=True)

    router = sub.add_parser("router", help="route OpenAI requests across running servers (prefix affinity, "
                                           "least outstanding tokens, health checks)")
    router.add_argument("--backend", action="append", default=[], help="a running server's base URL (repeat)")
    router.add_argument("--serve", action="append", default=[], metavar="ARGS",
                        help="start a server with these `minivllm serve` arguments behind the router (repeat: "
                             "one per model, e.g. --serve 'MODEL --served-model-name a')")
    router.add_argument("--host", default="0.0.0.0")
    router.add_argument("--port", type=int, default=8000)
    router.add_argument("--health-interval", type=float, default=2.0, help="seconds between health checks")
    router.add_argument("--api-key", default=envs.MINIVLLM_API_KEY,
                        help="key the router uses for the backends' /v1/models (clients' keys are forwarded; "
                             "default: $MINIVLLM_API_KEY)")

    for name, help_text in (("generate", "complete one prompt and print the text"),
                            ("chat", "send one user message through the chat template and print the reply")):
        one = sub.add_parser(name, help=help_text)
        one.add_argument("prompt", help="the prompt (generate) or user message (chat)")
        one.add_argument("--model", default=None, help="model (default: the default model)")
        one.add_argument("--max-tokens", type=int, default=None,
                         help="tokens to generate (default: 64 for generate, 256 for chat)")
        one.add_argument("--temperature", type=float, default=0.0)
        one.add_argument("--top-p", type=float, default=1.0)
        one.add_argument("--system", default=None, help="system message (chat only)")
        add_engine_args(one)
    add_quantization_commands(sub)
    return parser


def serve_specs(texts: list[str]) -> list[tuple[list[str], int]]:
    """`minivllm router --serve "MODEL --served-model-name a -tp 2" ...`: each text is the arguments of
    one `minivllm serve`; its --data-parallel-size becomes that many (serve argv, GPUs it takes) entries."""
    specs = []
    for text in texts:
        argv = ["serve"] + shlex.split(text)
        args = build_parser().parse_args(argv)
        specs += [(argv, args.tensor_parallel_size)] * args.data_parallel_size
    return specs


def add_quantization_commands(sub) -> None:
    quantize = sub.add_parser("quantize", help="quantize a checkpoint offline into a GPTQ-, AWQ- or W8A8 folder")
    quantize.add_argument("model", nargs="?", default=None, help="HF folder or .gguf file (default model when omitted)")
    quantize.add_argument("--method", required=True, choices=["rtn", "gptq", "awq", "smoothquant"],
                          help="smoothquant writes an unquantized, smoothed folder to serve with --quantization int8/fp8")
    quantize.add_argument("--bits", type=int, default=4, choices=[4, 8])
    quantize.add_argument("--group-size", type=int, default=128, help="inputs per scale (-1: one per output channel)")
    quantize.add_argument("--calib", default=None, help="calibration text file (gptq, awq)")
    quantize.add_argument("--num-samples", type=int, default=32, help="calibration windows")
    quantize.add_argument("--seq-len", type=int, default=256, help="tokens per calibration window")
    quantize.add_argument("--sym", action=argparse.BooleanOptionalAction, default=None,
                          help="symmetric (default for rtn/gptq) or with zero points (awq)")
    quantize.add_argument("--desc-act", action="store_true", help="gptq: quantize columns in activation order")
    quantize.add_argument("--alpha", type=float, default=0.5, help="smoothquant: migration strength")
    quantize.add_argument("--w8a8", choices=["fp8", "int8"], default=None,
                          help="rtn/gptq: write 8-bit weights with per-channel scales for dynamic per-token "
                               "activations (compressed-tensors), instead of a weight-only folder")
    quantize.add_argument("--smoothquant-alpha", type=float, default=None,
                          help="rtn/gptq: apply SmoothQuant with this migration strength before rounding")
    quantize.add_argument("--sequential", action="store_true",
                          help="gptq: calibrate layer by layer on the outputs of the already quantized linears")
    quantize.add_argument("--fp8-inputs", action="store_true",
                          help="gptq --sequential --w8a8 fp8: round calibration activations per token to fp8 as served")
    quantize.add_argument("--target-full-precision", action="store_true",
                          help="gptq --sequential: fit each linear to the unquantized model's outputs (GPTAQ-style)")
    quantize.add_argument("--grid-search", action="store_true",
                          help="rtn/gptq int: each group's scale and zero from a grid of scaled ranges and shifted "
                               "zeros (least H-diagonal-weighted rounding error) instead of min/max")
    quantize.add_argument("--distill-steps", type=int, default=0,
                          help="after rounding, fine-tune the weights on their grids, the scales and the norms "
                               "towards the unquantized model's next-token distributions on --calib (Adam steps)")
    quantize.add_argument("--distill-lr", type=float, default=0.01,
                          help="distillation learning rate of the weights, in grid steps per Adam step")
    quantize.add_argument("--distill-scale-lr", type=float, default=0.001,
                          help="distillation learning rate of the scales' log-ratios and the norm weights")
    quantize.add_argument("--out", required=True, help="output folder")

    ppl = sub.add_parser("eval-ppl", help="perplexity of a text through the engine's prompt logprobs")
    ppl.add_argument("model", nargs="?", default=None)
    ppl.add_argument("--text", required=True, help="text file to score")
    ppl.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens")
    ppl.add_argument("--window", type=int, default=1024, help="tokens per window")
    ppl.add_argument("--stride", type=int, default=512, help="tokens between window starts")
    add_engine_args(ppl)


def _run_quantization_command(args: argparse.Namespace) -> None:
    if args.command == "quantize" and args.method == "smoothquant":
        from minivllm.quantization.smoothquant import smooth_model
        print(f"wrote {smooth_model(args.model, args.out, args.calib, args.alpha, args.num_samples, args.seq_len)}")
        return
    if args.command == "quantize":
        from minivllm.quantization.quantizer import quantize_model
        folder = quantize_model(args.model, args.method, args.out, args.bits, args.group_size, args.calib,
                                args.num_samples, args.seq_len, args.sym, args.desc_act, args.w8a8,
                                args.smoothquant_alpha, args.sequential, args.fp8_inputs,
                                args.target_full_precision, args.grid_search, args.distill_steps,
                                args.distill_lr, args.distill_scale_lr)
        print(f"wrote {folder}")
        return
    import json
    from pathlib import Path

    from minivllm.engine.llm import LLM
    from minivllm.engine.perplexity import perplexity
    config = engine_config_from_args(args)
    llm = LLM(config.model, **{k: v for k, v in vars(config).items() if k != "model"})
    ids = llm.get_tokenizer().encode(Path(args.text).read_text(encoding="utf-8", errors="replace"),
                                     add_special_tokens=False)[:args.max_tokens]
    print(json.dumps(perplexity(llm, ids, args.window, args.stride)))


def _run_once(args: argparse.Namespace) -> None:
    from minivllm.engine.llm import LLM
    from minivllm.sampling_params import SamplingParams

    config = engine_config_from_args(args)
    fields = {k: v for k, v in vars(config).items() if k != "model"}
    llm = LLM(config.model, **fields)
    default_max = 64 if args.command == "generate" else 256
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                            max_tokens=args.max_tokens or default_max)
    if args.command == "generate":
        output = llm.generate([args.prompt], params, use_tqdm=False)[0]
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}]
        output = llm.chat(messages, params, use_tqdm=False)[0]
    print(output.outputs[0].text)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.command in ("serve", "router") else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "router":
            if not args.backend and not args.serve:
                raise ValueError("the router needs --backend URL or --serve ARGS (at least one)")
            from minivllm.router.launcher import route_and_serve
            route_and_serve(args.backend, serve_specs(args.serve), args.host, args.port, args.health_interval,
                            args.api_key)
        elif args.command == "serve" and args.data_parallel_size != 1:
            from minivllm.router.launcher import serve_data_parallel
            serve_data_parallel(argv, args.data_parallel_size, args.tensor_parallel_size, args.host, args.port,
                                args.uvicorn_log_level)
        elif args.command == "serve":
            from minivllm.server.api_server import run_server
            from minivllm.server.lora import parse_lora_modules
            run_server(engine_config_from_args(args), host=args.host, port=args.port,
                       served_model_name=args.served_model_name, api_key=args.api_key,
                       log_level=args.uvicorn_log_level, limits=server_limits_from_args(args),
                       shutdown_timeout=args.shutdown_timeout, tool_call_parser=args.tool_call_parser,
                       enable_auto_tool_choice=args.enable_auto_tool_choice,
                       lora_modules=parse_lora_modules(args.lora_modules),
                       allow_runtime_lora_updating=args.allow_runtime_lora_updating)
        elif args.command in ("quantize", "eval-ppl"):
            _run_quantization_command(args)
        else:
            _run_once(args)
    except ValueError as e:  # bad flags or input: a clear message, not a traceback
        print(f"minivllm: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
