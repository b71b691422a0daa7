"""llama.cpp's side of bench/peer/peer.py, through llama-cpp-python: whether it is installed, the GGUF files it reads
(written by the toolkit's exporter, `export.py --format gguf`), and its measuring processes on the workload of
bench/peer/peer_children.py (`llama-*`: greedy decoding of one sequence; `llama-batch-*-bN`: N sequences decoded
together in one llama.cpp batch per step).

The measuring processes run this file (`python bench/peer/peer_llama.py --child ...`), not peer.py: they import
llama_cpp and numpy only (about 40 MB), where peer.py's children also hold torch's import (about 0.2 GB); the
prompt ids are drawn by peer.py (`peer_children.prompt`, the ids the other runtimes get) and passed in as JSON
(`--workload`). Tokens are fed as ids and the next token is the argmax of the logits, taken here.

- `llama-*`: `llama_cpp.Llama(file, n_ctx=PROMPT_LEN + NEW_TOKENS + 8, n_batch=PROMPT_LEN, n_threads=T,
  n_threads_batch=T, flash_attn=True)` (flash attention: what llama.cpp's own default, auto, resolves to on a CPU;
  llama-cpp-python's default turns it off), then through its context the low-level API (`Greedy`): the warm-up
  (an 8-token prompt, 2 new tokens; it also faults the mapped weights in), the memory cleared, a 64-token prompt as
  one `llama_decode` (prefill ms: that call and the argmax), then 63 single-token `llama_decode` calls (decode
  ms/token: their mean, as chatglm.cpp's and the toolkit's processes report it; the median is recorded beside).
- `llama-batch-*-bN`: llama-cpp-python's `Llama` has no `n_seq_max` setting, so the model and the context are made
  with the low-level calls (`llama_model_load_from_file` with the default model parameters, as `Llama` does;
  `llama_init_from_model` with the same context settings plus n_seq_max = N, n_ctx = N x (PROMPT_LEN +
  EXTRACT_NEW_TOKENS), n_batch = N x PROMPT_LEN: the N prompts go in as one `llama_decode`, split by llama.cpp
  into ubatches of at most 512 tokens). One `llama_batch` (`llama_batch_init`) holds each entry's token,
  position, sequence id (`n_seq_id` = 1, `seq_id` = the row) and logits flag (the last token of each row); each
  step is one `llama_decode` of one token per row, and `llama_get_logits_ith` gives each row's logits.
  records/s = N / the wall time of the prefill and the 32 steps. The multi-sequence API works in llama-cpp-python
  0.3.36: on the --quick slice's f16 file, each row of a batch of 32 gets the logits it gets alone within 0.016 (the
  batched matmuls round differently), so the greedy tokens agree but where a random model's top two are nearly
  tied; on a tiny model every row's tokens are the toolkit's (tests/test_benches.py). A binding this file needs
  that is missing in the installed version makes the step return `{"skipped": why}`, recorded as not run.

llama.cpp cannot run ChatGLM-6B (no llama.cpp architecture: GLM's 2D positions, bidirectional attention over the
prompt); for `--version chatglm` peer.py records the gguf-*/llama-* steps as not run, with `NO_CHATGLM6B`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository: chatglm_tune, bench.<room>.<module>
LLAMA_TYPES = ("f16", "q8_0", "q4_0")  # the GGUF files written (`export.py --type`) and run
BATCH_TYPES = ("q8_0", "q4_0")  # llama-batch-*: the quantized files, which extraction runs on
INSTALL = 'CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python'
# A second build, for CPUs without AVX-512 (peer.py --capability avx2 --llama-cpp DIR): ggml's AVX2 kernels only
INSTALL_AVX2 = ('CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON '
                '-DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF" '
                'pip install --no-deps --target DIR llama-cpp-python')
NO_CHATGLM6B = ("llama.cpp has no ChatGLM-6B architecture (GLM's 2D positions, bidirectional attention over the "
                "prompt; export.py writes no GGUF of it); chatglm.cpp runs it (convert-*/cpp-*)")
NEEDED = ("llama_batch_init", "llama_batch_free", "llama_decode", "llama_get_logits_ith", "llama_get_memory",
          "llama_memory_clear", "llama_model_load_from_file", "llama_init_from_model", "llama_model_get_vocab",
          "llama_vocab_n_tokens", "llama_n_ctx")
UBATCH = 512  # llama.cpp's default physical batch, as `Llama` caps n_ubatch


def has_llama_cpp() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


# ---------------------------------------------------------------------------------------------- peer.py's side


def gguf_path(model_dir: Path, dtype: str) -> Path:
    """Where `gguf-<dtype>` writes the file: `<model_dir>-gguf-<dtype>/<model_dir's name>-<dtype>.gguf` beside the
    checkpoint (export.py names the file `<--name>-<--type>.gguf` in its output directory)."""
    return model_dir.with_name(f"{model_dir.name}-gguf-{dtype}") / f"{model_dir.name}-{dtype}.gguf"


def export_args(model_dir: Path, dtype: str) -> list:
    """export.py and its arguments for `gguf-<dtype>` (its output directory must be new or empty: `remove_gguf`)."""
    return [ROOT / "export.py", model_dir, gguf_path(model_dir, dtype).parent, "--format", "gguf", "--type", dtype,
            "--name", model_dir.name]


def remove_gguf(model_dir: Path, dtype: str) -> None:
    """Delete what `gguf-<dtype>` wrote (the GGUF file, the ollama Modelfile beside it, their directory if empty)."""
    path = gguf_path(model_dir, dtype)
    for old in (path, path.parent / "Modelfile"):
        old.unlink(missing_ok=True)
    if path.parent.is_dir() and not any(path.parent.iterdir()):
        path.parent.rmdir()


def workload(frame: dict, batch: int | None = None, prompt_len: int | None = None) -> str:
    """The prompt ids of `llama-*` (batch None: the one prompt of `prompt_len` tokens, default 64, the other runtimes
    decode 64 tokens after) or `llama-batch-*-bN` (the N prompts of `batch-*-bN`), with the warm-up, as JSON for
    `--workload`."""
    from bench.peer.peer_children import (EXTRACT_NEW_TOKENS, NEW_TOKENS, PROMPT_LEN, WARMUP_PROMPT,
                                          WARMUP_TOKENS, prompt)

    prompts = prompt(frame, prompt_len or PROMPT_LEN, 0) if batch is None else prompt(frame, PROMPT_LEN, 3, batch)
    return json.dumps({"warmup": prompt(frame, WARMUP_PROMPT, 1)[0], "warmup_new": WARMUP_TOKENS, "prompts": prompts,
                       "new": NEW_TOKENS if batch is None else EXTRACT_NEW_TOKENS})


# ---------------------------------------------------------------------------------------------- the children


def _wrong_build(llama_cpp, capability: str | None) -> str | None:
    """Why the imported llama.cpp cannot stand for a CPU of `capability` ("avx2": no AVX-512 kernels), else None."""
    info = llama_cpp.llama_print_system_info().decode()
    if capability == "avx2" and "AVX512 = 1" in info:
        return (f"the llama.cpp at {Path(llama_cpp.__file__).parent} was built with AVX-512 kernels; for --capability "
                f"avx2 build one without them ({INSTALL_AVX2}) and pass --llama-cpp DIR")
    return None


def _missing() -> list[str]:
    import llama_cpp

    return [name for name in NEEDED if not hasattr(llama_cpp, name)]


class Greedy:
    """Greedy next tokens of up to `n_seqs` sequences per `llama_decode` on a llama.cpp context: sequence s is row s
    of the batch (seq_id s), its tokens at consecutive positions, logits only at its last token."""

    def __init__(self, ctx, model, capacity: int, n_seqs: int):
        import llama_cpp

        self.lib, self.ctx = llama_cpp, ctx
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        self.batch = llama_cpp.llama_batch_init(capacity, 0, 1)
        self.capacity, self.n_seqs = capacity, n_seqs

    def step(self, rows: list[list[int]], start: list[int]) -> list[int]:
        """Feed `rows[s]` to sequence s at positions start[s]...; the argmax of each row's last logits."""
        import numpy as np

        b, n, last = self.batch, 0, []
        assert len(rows) <= self.n_seqs and sum(map(len, rows)) <= self.capacity
        for s, ids in enumerate(rows):
            for j, token in enumerate(ids):
                b.token[n], b.pos[n], b.n_seq_id[n], b.logits[n] = token, start[s] + j, 1, j == len(ids) - 1
                b.seq_id[n][0] = s
                n += 1
            last.append(n - 1)
        b.n_tokens = n
        code = self.lib.llama_decode(self.ctx, b)
        if code != 0:
            raise RuntimeError(f"llama_decode returned {code} for {len(rows)} rows of {n} tokens")
        return [int(np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,)).argmax())
                for i in last]

    def generate(self, prompts: list[list[int]], new: int) -> tuple[list[float], list[list[int]]]:
        """`new` greedy tokens after each prompt, from empty memory: (the time after each call, its start first; the
        tokens of each row)."""
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        stamps, out = [time.perf_counter()], [[] for _ in prompts]
        feed, start = prompts, [0] * len(prompts)
        for _ in range(new):
            for row, token in zip(out, self.step(feed, start)):
                row.append(token)
            stamps.append(time.perf_counter())
            start = [s + len(f) for s, f in zip(start, feed)]
            feed = [[row[-1]] for row in out]
        return stamps, out

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)


def _common(llama_cpp, threads: int) -> dict:
    return {"llama_cpp_python": llama_cpp.__version__, "threads": threads, "flash_attn": True,
            "os_threads": len(os.listdir("/proc/self/task")),
            "system_info": llama_cpp.llama_print_system_info().decode().strip()}


def child_llama(args, work: dict) -> dict:
    """One sequence: load, warm-up, the prompt as one call, then single-token calls (see the module docstring)."""
    import logging

    import llama_cpp

    from bench.common.measure import peak_rss

    if _missing():
        return {"skipped": f"llama-cpp-python {llama_cpp.__version__} lacks {', '.join(_missing())}"}
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    prompt_len, new = len(work["prompts"][0]), work["new"]
    start = time.perf_counter()
    llm = llama_cpp.Llama(str(args.gguf), n_ctx=prompt_len + new + 8, n_batch=prompt_len, n_threads=args.threads,
                          n_threads_batch=args.threads, flash_attn=True, verbose=False)
    load_s, rss_load = time.perf_counter() - start, peak_rss()
    greedy = Greedy(llm.ctx, llm.model, prompt_len, 1)
    greedy.generate([work["warmup"]], work["warmup_new"])
    stamps, (out,) = greedy.generate(work["prompts"], new)
    steps = [b - a for a, b in zip(stamps[1:], stamps[2:])]
    record = {"load_s": load_s, "prompt_len": prompt_len, "prefill_ms": (stamps[1] - stamps[0]) * 1e3,
              "decode_ms": statistics.mean(steps) * 1e3,
              "decode_median_ms": statistics.median(steps) * 1e3, "rss_load_gb": rss_load / 1e9,
              "distinct_tokens": len(set(out)), "first_tokens": out[:8], "n_ctx": llama_cpp.llama_n_ctx(llm.ctx),
              **_common(llama_cpp, args.threads)}
    greedy.close()
    llm.close()
    return record


def _batch_context(llama_cpp, path: str, threads: int, n_seqs: int, n_ctx: int, n_batch: int):
    """(model, context): `Llama`'s model parameters and context settings, with n_seq_max = `n_seqs`."""
    model = llama_cpp.llama_model_load_from_file(path.encode(), llama_cpp.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = n_ctx, n_batch, min(n_batch, UBATCH), n_seqs
    params.n_threads = params.n_threads_batch = threads
    params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
    ctx = llama_cpp.llama_init_from_model(model, params)
    if not ctx:
        raise RuntimeError(f"llama.cpp made no context of n_ctx {n_ctx}, n_batch {n_batch}, n_seq_max {n_seqs}")
    return model, ctx


def child_llama_batch(args, work: dict) -> dict:
    """N sequences decoded together (see the module docstring): records/s of one batch of extraction records; the
    tokens of row 0 begin `first_tokens`, each row's last token is in `last_tokens` (it depends on the whole row)."""
    import logging

    import llama_cpp

    if _missing():
        return {"skipped": f"llama-cpp-python {llama_cpp.__version__} lacks {', '.join(_missing())}"}
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    llama_cpp.llama_backend_init()
    prompts, new = work["prompts"], work["new"]
    n, prompt_len = len(prompts), len(prompts[0])
    start = time.perf_counter()
    model, ctx = _batch_context(llama_cpp, str(args.gguf), args.threads, n, n * (prompt_len + new), n * prompt_len)
    load_s = time.perf_counter() - start
    greedy = Greedy(ctx, model, n * prompt_len, n)
    greedy.generate([work["warmup"]], work["warmup_new"])
    stamps, out = greedy.generate(prompts, new)
    seconds = stamps[-1] - stamps[0]
    assert all(len(row) == new for row in out)
    record = {"load_s": load_s, "batch": n, "seconds": seconds, "records_per_s": n / seconds,
              "prefill_s": stamps[1] - stamps[0], "step_ms": (stamps[-1] - stamps[1]) / (new - 1) * 1e3,
              "first_tokens": out[0][:8], "last_tokens": [row[-1] for row in out], "n_ctx": llama_cpp.llama_n_ctx(ctx),
              **_common(llama_cpp, args.threads)}
    greedy.close()
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)
    return record


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="a measuring process of bench/peer/peer.py's llama.cpp steps")
    p.add_argument("--child", choices=["llama", "llama-batch"], required=True)
    p.add_argument("--gguf", type=Path, required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--workload", type=json.loads, required=True, help="`workload()`'s JSON")
    p.add_argument("--capability", choices=["avx2"], help="refuse a llama.cpp built with kernels beyond this ISA")
    args = p.parse_args(argv)
    if args.capability:
        import llama_cpp

        wrong = _wrong_build(llama_cpp, args.capability)
        if wrong:
            raise SystemExit(wrong)
    child = child_llama if args.child == "llama" else child_llama_batch
    print(json.dumps(child(args, args.workload)))


if __name__ == "__main__":
    main()
