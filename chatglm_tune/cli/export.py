"""Export a ChatGLM model or train.py run to the engines people deploy with.

    python export.py RUN_DIR OUT_DIR                              # GGUF (f16) + ollama Modelfile: llama.cpp, ollama
    python export.py RUN_DIR OUT_DIR --type q4_0                  # GGUF in llama.cpp's INT4 blocks (q8_0: INT8)
    python export.py RUN_DIR OUT_DIR --format hf                  # transformers-native directory: transformers, vLLM
    python export.py CHATGLM6B_RUN OUT_DIR --format ggml --type q4_0   # chatglm.cpp's file (ChatGLM-6B, ChatGLM2/3)
    python export.py MODEL_DIR OUT_DIR --lora ADAPTER             # a base + a peft LoRA adapter, merged

What is exported: a model directory, a full fine-tuning run, a LoRA run (merged into its float base). Not exported:
P-tuning runs (their prefix is a KV cache that no engine takes) and INT8/INT4 directories (export the float source and
choose --type). GGUF holds ChatGLM2/3, GLM-4 and GLM-Edge (llama.cpp's `chatglm` architecture), GLM-4-0414 (`glm4`),
GLM-4.5 / 4.6 / 4.7 (`glm4moe`), GLM-4.7-Flash (`deepseek2`) and GLM-5 (`glm-dsa`); llama.cpp cannot run ChatGLM-6B,
whose GGML file chatglm.cpp runs. OUT_DIR must be new or empty, in a directory this process may write (checked before
any weight is read); the export is written in `.OUT_DIR.partial` beside it and renamed to OUT_DIR when complete: an
error, Ctrl-C, SIGTERM or SIGUSR1 removes it (exit 130 / 143 / 138 for the signals), OUT_DIR is left as it was and the
same command runs again; run again on a finished OUT_DIR, it says so and exits 0. GGUF and GGML need the `export` extra
(`pip install -e ".[export]"`: gguf-py).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from chatglm_tune import cli
from chatglm_tune.cli.config import CommandParser
from chatglm_tune.options import (EXPORT_FORMAT, EXPORT_FORMATS, EXPORT_TYPE, EXPORT_TYPES, LOAD_DTYPES,
                                  THREADS_PER_CPU, choose_threads, threads_problem)

INSTALL_EXPORT = 'pip install -e ".[export]"'


def parse_args(argv=None) -> argparse.Namespace:
    p = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", type=Path,
                   help="model directory (float weights, config.json) or a train.py full / LoRA run")
    p.add_argument("out_dir", type=Path, help="new (or empty) directory for the exported files")
    p.add_argument("--format", choices=EXPORT_FORMATS, default=EXPORT_FORMAT,
                   help="gguf: llama.cpp / ollama; hf: transformers / vLLM / SGLang; ggml: chatglm.cpp "
                        "(default %(default)s)")
    p.add_argument("--type", choices=EXPORT_TYPES, default=None,
                   help=f"gguf / ggml: the matrices' precision, ggml's f16, bf16 (gguf only), q8_0 or q4_0 blocks "
                        f"(default {EXPORT_TYPE}); hf writes the weights as loaded (--dtype)")
    p.add_argument("--lora", type=Path,
                   help="peft LoRA adapter directory to merge into MODEL_DIR first (default: none)")
    p.add_argument("--dtype", choices=("auto", *LOAD_DTYPES), default="auto",
                   help="dtype the model is loaded (and merged) in; auto = as stored (default %(default)s)")
    p.add_argument("--name",
                   help="the model's name in the GGUF file and the ollama Modelfile (default: OUT_DIR's name)")
    p.add_argument("--threads", type=int, help=f"torch CPU threads, at most {THREADS_PER_CPU} a CPU (default: "
                   "OMP_NUM_THREADS when set, else torch's)")
    args = p.parse_args(argv)
    if threads_problem(args.threads):
        p.error(threads_problem(args.threads))
    return args


def made(args) -> dict:
    """What this command's output records of it (`destination.made_by`)."""
    from chatglm_tune.export.destination import made_by

    return made_by("export.py", [args.model_dir, args.lora], format=args.format, type=args.type, dtype=args.dtype,
                   name=args.name, model_dir=str(args.model_dir.resolve()),
                   lora=str(args.lora.resolve()) if args.lora else None)


def check_args(args) -> bool:
    """ValueError naming every problem found before any weight is read; True where OUT_DIR already holds this
    command's finished export."""
    from chatglm_tune.export.destination import check_destination

    problems = []
    if args.format == "hf" and args.type is not None:
        problems.append("--type applies to gguf and ggml files; an hf directory holds the weights as loaded (--dtype)")
    if args.format == "ggml" and args.type == "bf16":
        problems.append("chatglm.cpp's GGML files hold f16, q8_0 or q4_0 matrices, not bf16")
    if args.format in ("gguf", "ggml"):
        try:
            import gguf  # noqa: F401
        except ImportError:
            problems.append(f"--format {args.format} needs the gguf package (gguf-py): {INSTALL_EXPORT}")
    done = False
    try:
        done = check_destination(args.out_dir, made(args))
    except ValueError as err:
        problems.append(str(err))
    if problems:
        raise ValueError("; ".join(problems))
    return done


def export(args, threads: int | None = None) -> tuple[list[Path], object]:
    """Write the export into `args.out_dir`, whole or not at all, on `threads` torch threads (None: torch's);
    (the main files written, the `Exportable`)."""
    import torch

    from chatglm_tune.export.destination import writing_into
    from chatglm_tune.export.source import open_export

    if threads:
        torch.set_num_threads(threads)
    with writing_into(args.out_dir, made(args)) as partial:  # made before any weight is read
        source = open_export(args.model_dir, lora=args.lora, dtype=args.dtype, form=args.format)
        written = write(args, source, partial)
    return [args.out_dir / path.relative_to(partial) for path in written], source


def write(args, source, out: Path) -> list[Path]:
    """Write `source` into the directory `out` in `args.format`, with a progress bar (hf: bytes of weights, the
    others: tensors); the main files (hf: the directory)."""
    from tqdm import tqdm

    kind = args.type or EXPORT_TYPE
    name = args.name or args.out_dir.name
    hf = args.format == "hf"
    bars = []  # made at the first call, when the total is known

    def progress(done: int, total: int) -> None:
        if not bars:
            bars.append(tqdm(desc=args.format if hf else f"{args.format} {kind}", total=total,
                             unit="B" if hf else "tensor", unit_scale=hf))
        bars[0].update(done - bars[0].n)

    try:
        if hf:
            from chatglm_tune.export.hf_dir import write_hf

            write_hf(out, source.model, source.tokenizer, chat_template=source.chat_template, sampling=source.sampling,
                     progress=progress)
            return [out]
        if args.format == "gguf":
            from chatglm_tune.export.gguf_file import write_gguf
            from chatglm_tune.export.ollama import modelfile

            path = out / f"{name}-{kind}.gguf"
            # first: it may refuse; the tokenizer's format follows its chat template's form (GLM-4.7's: 4.7's)
            text = modelfile(source.tokenizer.prompt_format, path.name, source.run_prompt, source.sampling)
            write_gguf(path, source.config, source.tokenizer, source.tensors, kind, name=name,
                       chat_template=source.gguf_chat_template, sampling=source.sampling, progress=progress)
            (out / "Modelfile").write_text(text, encoding="utf-8")
            return [path, out / "Modelfile"]
        from chatglm_tune.export.ggml_file import official_layout, write_ggml

        path = out / f"{name}-{kind}.ggml"
        config, state = official_layout(source.model)
        write_ggml(path, source.version.ggml_model_type, config, state.__getitem__,
                   source.tokenizer.sp_model.serialized_model_proto(), kind, progress=progress)
        return [path]
    finally:
        for bar in bars:
            bar.close()


def how_to_run(args, files: list[Path], version) -> str:
    """The commands that run what was written (`version`: the exported model's `models.version.Version`)."""
    out = args.out_dir
    if args.format == "hf" and version.hf_native:
        return (f"run it:  python -c \"from transformers import AutoModelForCausalLM; "
                f"AutoModelForCausalLM.from_pretrained('{out}')\"\n"
                f"         vllm serve {out}")
    if args.format == "hf":  # transformers and vLLM have no class of it: the official layout
        return (f"run it:  {cli.hint('infer')} --model {out} --text TEXT    (this toolkit; "
                f"{cli.hint('serve')} --model {out} "
                "serves it)\n"
                f"         python -c \"import chatglm_tune; from transformers import AutoModel; "
                f"AutoModel.from_pretrained('{out}')\"\n"
                f"         {version.title} has no transformers class (nor vLLM): its official remote code loads it "
                f"too, its *.py and auto_map\n         beside the files, with "
                f"AutoModel.from_pretrained('{out}', trust_remote_code=True)")
    if args.format == "gguf":
        return (f"run it:  llama-cli -m {files[0]} -cnv     (llama.cpp)\n"
                f"         cd {args.out_dir} && ollama create {files[0].stem} -f Modelfile && "
                f"ollama run {files[0].stem}")
    return f"run it:  chatglm.cpp's  ./build/bin/main -m {files[0]} -i   (Python: chatglm_cpp.Pipeline('{files[0]}'))"


def main(argv=None) -> None:
    from chatglm_tune.runtime.stopping import exit_status, signal_name, signals_stop

    args = parse_args(argv)
    try:
        with signals_stop():  # SIGTERM and SIGUSR1 as Ctrl-C: the export in progress is removed on the way out
            if check_args(args):
                print(f"export.py: {args.out_dir} already holds this export of {args.model_dir}: nothing to do")
                return
            threads, threads_origin = choose_threads(args.threads, None, "")
            start = time.perf_counter()
            files, source = export(args, threads)
    except (ValueError, FileNotFoundError) as err:  # CheckpointError, RunDirectoryError, ExportError are ValueErrors
        print(f"export.py: error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as interrupt:
        print(f"export.py: interrupted by {signal_name(interrupt)}; what was written is removed ({args.out_dir} is as "
              "it was)", file=sys.stderr)
        sys.exit(exit_status(interrupt))
    seconds = time.perf_counter() - start
    import torch

    cores = torch.get_num_threads()
    size = sum(f.stat().st_size for path in files for f in ([path] if path.is_file() else path.rglob("*"))
               if f.is_file())
    for note in source.notes:
        print(f"note: {note}")
    print(f"{args.model_dir}{f' + {args.lora}' if args.lora else ''} -> {', '.join(map(str, files))} "
          f"({args.format}{'' if args.format == 'hf' else ' ' + (args.type or EXPORT_TYPE)}): "
          f"{size / 1e6:,.1f} MB in {seconds:.1f} s, "
          f"{cores} thread{'s' * (cores != 1)} ({threads_origin})")
    print(how_to_run(args, files, source.version))


if __name__ == "__main__":
    main()
