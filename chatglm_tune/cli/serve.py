"""Serve a ChatGLM-6B, ChatGLM2/3 or GLM-4 model or train.py run directory over OpenAI's HTTP API, with
continuous batching (requests join and leave the running batch at every decoding step).

    python serve.py --model checkpoints/run1                       # http://127.0.0.1:8000/ : the chat page
    python serve.py --model checkpoints/run1 --quantization-bit 4 --api-key SECRET --port 8080
    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"messages": [{"role": "user", "content": "你好"}]}'

Routes: GET /, /health, /v1/models; POST /v1/chat/completions, /v1/completions (both stream with
"stream": true), /v1/extract ({"texts": [...]} -> triples). Needs `pip install -e ".[serve]"`.
Ctrl-C / SIGTERM: new requests get 503; running ones get --shutdown-grace seconds to finish, then end with an
error (a stream: an error event, then [DONE]); a second signal ends the grace at once.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from chatglm_tune.cli.config import CommandParser
from chatglm_tune.options import (DEFAULT_DRAFTS, LOAD_DTYPES, MAX_BATCH_LIMIT, QUANTIZATION_BITS, THREADS_PER_CPU,
                                  ServingOptions, threads_problem)

DEFAULTS = ServingOptions()
SHUTDOWN_GRACE_S = 5.0


def parse_args(argv=None) -> argparse.Namespace:
    p = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a ChatGLM-6B, ChatGLM2/3, GLM-4 (9B, 0414, Edge), GLM-4.5 / 4.6 / "
                   "4.7 or GLM-4.7-Flash model directory, or a train.py run directory (full, P-tuning or LoRA: it "
                   "names its base)")
    adapter = p.add_mutually_exclusive_group()
    adapter.add_argument("--ptuning-checkpoint", type=Path, help="P-tuning v2 checkpoint directory to load on --model")
    adapter.add_argument("--lora", type=Path, help="peft LoRA adapter directory to merge into --model")
    p.add_argument("--served-model-name", help="the model id clients name (default: the --model directory's name)")
    p.add_argument("--quantization-bit", type=int, choices=QUANTIZATION_BITS,
                   help="INT8/INT4 block Linears (default: as the model was trained)")
    p.add_argument("--quantize-embedding", action=argparse.BooleanOptionalAction,
                   help="hold the embedding and output head in INT8 (default: as the run trained)")
    p.add_argument("--dtype", choices=(*LOAD_DTYPES, "auto"),
                   help="compute dtype (default: float32 on CPU, float16 on CUDA)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N, or auto (default %(default)s)")
    p.add_argument("--threads", type=int, help=f"torch CPU threads, at most {THREADS_PER_CPU} a CPU (default: "
                   "OMP_NUM_THREADS, else the run's, else torch's)")
    p.add_argument("--host", default=DEFAULTS.host, help="address to listen on (default %(default)s)")
    p.add_argument("--port", type=int, default=DEFAULTS.port,
                   help="port to listen on, 0 = any free one (default %(default)s)")
    p.add_argument("--max-batch", type=int, default=DEFAULTS.max_batch,
                   help=f"requests decoded together at most (up to {MAX_BATCH_LIMIT}); 1 serves one at a time "
                        "(default %(default)s)")
    p.add_argument("--max-queue", type=int, default=DEFAULTS.max_queue,
                   help="requests waiting beyond the batch at most; more get HTTP 429 (default %(default)s)")
    p.add_argument("--prefill-tokens", type=int, default=DEFAULTS.prefill_tokens,
                   help="prompt tokens prefilled per decoding step at most: how long a newcomer can stall running "
                        "streams (default %(default)s)")
    p.add_argument("--speculative", action=argparse.BooleanOptionalAction, default=DEFAULTS.drafts is not None,
                   help="greedy requests guess their next tokens from their own text and check them in one step: the "
                        "same answers in fewer steps, faster where a forward of a few tokens costs about one token's "
                        "(default: off; sampled requests decode plainly)")
    p.add_argument("--max-draft", type=int, help="with --speculative: guesses checked a step at most (default "
                   f"{DEFAULT_DRAFTS.max_draft}; 1 where each guess costs much of a token's forward, as with INT4 on "
                   "CPUs without AVX-512 VNNI)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=DEFAULTS.compiled,
                   help="decode the running batch in fixed buffers, each step one compiled function (CUDA graphs on a "
                        "GPU: the step launches once instead of hundreds of kernels); every version but ChatGLM-6B, "
                        "float or (on a GPU) INT8 / INT4; not with --speculative (default: off; it compiles "
                        "for each new batch and length bucket, seconds to a minute at first)")
    p.add_argument("--max-body-mb", type=float, default=DEFAULTS.max_body_mb,
                   help="request bodies over this many MB get HTTP 413 (default %(default)s)")
    p.add_argument("--cors-origin", action="append", default=list(DEFAULTS.cors_origins), metavar="ORIGIN",
                   help="let browser pages of ORIGIN (e.g. http://localhost:3000, or *) call the server: CORS headers; "
                        "repeatable (default: none, no CORS headers)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/ routes (default: open)")
    p.add_argument("--shutdown-grace", type=float, default=SHUTDOWN_GRACE_S,
                   help="seconds running requests get to finish on Ctrl-C / SIGTERM, new ones getting 503 meanwhile; "
                        "then those still running end with an error (a stream: an error event, then [DONE]); a "
                        "second signal ends the grace at once (default %(default)s)")
    args = p.parse_args(argv)
    if threads_problem(args.threads):
        p.error(threads_problem(args.threads))
    if args.max_draft is not None and (args.max_draft < 1 or not args.speculative):
        p.error(f"--max-draft must be >= 1, got {args.max_draft}" if args.max_draft < 1
                else "--max-draft applies only with --speculative")
    try:
        args.options = ServingOptions(max_batch=args.max_batch, max_queue=args.max_queue,
                                      prefill_tokens=args.prefill_tokens, host=args.host, port=args.port,
                                      drafts=DEFAULT_DRAFTS.capped(args.max_draft) if args.speculative else None,
                                      compiled=args.compile, max_body_mb=args.max_body_mb,
                                      cors_origins=tuple(args.cors_origin))
    except ValueError as err:
        p.error(str(err))
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    missing = [m for m in ("starlette", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"serve.py: error: {' and '.join(missing)} not installed: pip install -e \".[serve]\"", file=sys.stderr)
        sys.exit(2)

    from chatglm_tune.runs import loading
    from chatglm_tune.runtime import heap

    try:
        source = loading.resolve_run(args.model, ptuning_checkpoint=args.ptuning_checkpoint, lora=args.lora)
        model, tokenizer, line = loading.load_for_inference(
            source, device=args.device, dtype=args.dtype, threads=args.threads, quantization_bit=args.quantization_bit,
            quantize_embedding=args.quantize_embedding,
            note=lambda text: print(f"serve.py: note: {text}", file=sys.stderr))
    except (ValueError, FileNotFoundError) as err:
        print(f"serve.py: error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("serve.py: interrupted while loading", file=sys.stderr)
        sys.exit(130)
    heap.heap_large_blocks()  # prefills take again the large blocks the layer before freed (no page faults)
    speculation = "on for greedy requests" if args.options.drafts is not None else "off"
    compiled = "; compiled steps" if args.options.compiled else ""
    print(f"{line}; speculative decoding {speculation}{compiled}", file=sys.stderr)
    import uvicorn

    from chatglm_tune.serve.app import build_app
    from chatglm_tune.serve.server import DrainingServer
    from chatglm_tune.serve.service import Service

    served = args.served_model_name or Path(args.model).resolve().name
    columns = source.columns
    try:
        service = Service(model, tokenizer, served=served, encoding=source.encoding, free_text=columns.active,
                          options=args.options)
    except ValueError as err:  # --compile on a model compiled serving cannot hold (`slot_cache.unsupported`)
        print(f"serve.py: error: {err}", file=sys.stderr)
        sys.exit(2)
    app = build_app(service, api_key=args.api_key)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info", access_log=False)
    server = DrainingServer(config, service, args.shutdown_grace)
    server.run()  # Ctrl-C / SIGTERM: new requests get 503, running ones --shutdown-grace s, then an error and the end


if __name__ == "__main__":
    main()
