"""Every option of the toolkit and its default, in one place, importing nothing heavy.

The command lines (`train.py`, `infer.py`, `quantize.py`) build their flags and help texts from these
classes and constants before they import torch, so `--help` answers at once; the package reads the
same objects, so a default is written once. Validation lives with each class (`__post_init__`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path


def raise_problems(problems: list[str], prefix: str = "") -> None:
    """The ValueError of a validation that collects every problem before it raises: one message naming
    them all (`prefix` first, then the problems joined by "; "); nothing when `problems` is empty."""
    if problems:
        raise ValueError(prefix + "; ".join(problems))


# ------------------------------------------------------------------------------------------------
# Choices shared by the command lines

TUNINGS = ("ptuning", "lora", "full")
BAD_RECORD_MODES = ("error", "skip")  # stop at a bad record, or skip it and count it
LOAD_DTYPES = ("float32", "bfloat16", "float16")
MIXED_PRECISIONS = ("no", "fp16", "bf16")
SCHEDULES = ("cosine", "linear")
QUANTIZATION_BITS = (4, 8)
# `--compile` without a backend: inductor (generated kernels; what pays on a GPU). On a CPU a tiny GLM-4's training
# step ran no faster compiled, after a minute of compiling (figures: bench/results/kernel-notes.md), so training
# compiles nothing unless asked.
COMPILE_BACKEND = "inductor"

# Per method, for real models, as the official fine-tuning scripts run them: P-tuning v2 as ChatGLM-6B's
# ptuning/train.sh (lr 2e-2, pre_seq_len 128, 3000 steps of 1 row x 16 accumulated), LoRA as ChatGLM3's
# finetune_demo/configs/lora.yaml (lr 5e-5, r 8, alpha 32, dropout 0.1 on query_key_value, 3000 steps of
# 4 rows), full fine-tuning as ChatGLM-6B's ptuning/ds_train_finetune.sh (lr 1e-4, 5000 steps of 4 rows).
METHOD_DEFAULTS = {
    "ptuning": dict(lr=2e-2, max_steps=3000, batch_size=1, grad_accum=16),
    "lora": dict(lr=5e-5, max_steps=3000, batch_size=4, grad_accum=1),
    "full": dict(lr=1e-4, max_steps=5000, batch_size=4, grad_accum=1),
}
DEFAULT_LR = {tuning: d["lr"] for tuning, d in METHOD_DEFAULTS.items()}

# quantize.py: the official rule computes scales and W / scale in fp16.
QUANTIZE_DTYPE = "float16"

# export.py: what it writes (gguf: llama.cpp / ollama; hf: transformers / vLLM; ggml: chatglm.cpp) and the
# precision of a GGUF / GGML file's matrices (ggml's types; q8_0 / q4_0 are its INT8 / INT4 blocks).
EXPORT_FORMATS = ("gguf", "hf", "ggml")
EXPORT_FORMAT = "gguf"
EXPORT_TYPES = ("f16", "bf16", "q8_0", "q4_0")
EXPORT_TYPE = "f16"


LOSS_ON = ("all", "last")  # a conversation's assistant turns that carry a loss
REASONING_EFFORTS = ("low", "high", "max")  # the reasoning-effort lines GLM-5.2 / GLM-5.3-Flash's templates write


@dataclass(frozen=True)
class EncodingOptions:
    """The prompt and the length budget of a training row and of an inference prompt.

    `max_src_len`: tokens of the context, `prompt + text` plus `[gMASK]`. `max_len`: the whole row,
    so `<sop> answer <eop>` gets `max_len - max_src_len` tokens (a conversation record's row, as its official
    code builds it, is cut at `max_len`). `loss_on`: "all" trains a conversation on every assistant turn, as the
    official ChatGLM3 / GLM-4 fine-tuning does; "last" on the last one only, the earlier turns context.
    `enable_thinking` / `clear_thinking`: the agent GLMs' chat template flags for a conversation record that sets
    none of its own (None: thinking on exactly where the record holds reasoning; the template's clear_thinking).
    `reasoning_effort`: the template kwarg of the releases that write a reasoning-effort line (GLM-5.2: "high" or
    "max"; None: the template's default, max).
    """

    prompt: str = "按给定的格式抽取文本信息。\n文本："
    max_src_len: int = 256
    max_len: int = 288
    loss_on: str = "all"
    enable_thinking: bool | None = None
    clear_thinking: bool | None = None
    reasoning_effort: str | None = None

    def __post_init__(self):
        if self.reasoning_effort not in (None, *REASONING_EFFORTS):
            raise ValueError(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, "
                             f"not {self.reasoning_effort!r}")
        if self.loss_on not in LOSS_ON:
            raise ValueError(f"loss_on must be one of {', '.join(LOSS_ON)}, got {self.loss_on!r}")
        if self.max_src_len < 2:
            raise ValueError("max_src_len must be >= 2 (at least one source token and [gMASK]), "
                             f"got {self.max_src_len}")
        if self.max_len - self.max_src_len < 2:
            raise ValueError(
                f"max_len ({self.max_len}) must exceed max_src_len ({self.max_src_len}) by at least 2 (<sop> and <eop>)"
            )

    @property
    def max_source_tokens(self) -> int:
        """Tokens kept of `prompt + text` (before `[gMASK] <sop>`)."""
        return self.max_src_len - 1

    @property
    def max_answer_tokens(self) -> int:
        """Tokens kept of the answer (between `<sop>` and `<eop>`)."""
        return self.max_len - self.max_src_len - 2

    @property
    def answer_budget(self) -> int:
        """Tokens generated after `<sop>` at most (the answer and its `<eop>`), as training saw them."""
        return self.max_len - self.max_src_len


@dataclass(frozen=True)
class DataColumns:
    """Prompt/response data in the official ChatGLM P-tuning shape (`--prompt-column content
    --response-column summary`, AdvertiseGen's): the prompt (with the `history` column's earlier turns as
    the official multi-turn prompt) and a free-text answer, scored by the generation metrics. None (the
    default): the SPO shapes of `records.read_records`."""

    prompt: str | None = None
    response: str | None = None
    history: str | None = None

    def __post_init__(self):
        if self.prompt is None and (self.response is not None or self.history is not None):
            raise ValueError("--response-column and --history-column need --prompt-column")

    @property
    def active(self) -> bool:
        return self.prompt is not None


@dataclass(frozen=True)
class LoraOptions:
    """LoRA hyper-parameters (peft's `LoraConfig` is built from them in `lora.py`); `target` None: the
    version's attention projections (its `Version.lora_targets`: query_key_value, or q_proj k_proj v_proj)."""

    r: int = 8
    alpha: int = 32
    dropout: float = 0.1
    target: tuple[str, ...] | None = None

    def __post_init__(self):
        problems = [f"lora_{name} must be >= 1, got {getattr(self, name)}" for name in ("r", "alpha")
                    if getattr(self, name) < 1]
        if not 0 <= self.dropout < 1:
            problems.append(f"lora_dropout must be in [0, 1), got {self.dropout}")
        raise_problems(problems)


@dataclass(frozen=True)
class TrainOptions:
    """Every training option and its default (train.py's flags are these fields)."""

    tuning: str = "ptuning"
    pre_seq_len: int = 128
    prefix_projection: bool = False
    lora: LoraOptions = field(default_factory=LoraOptions)
    encoding: EncodingOptions = field(default_factory=EncodingOptions)
    columns: DataColumns = field(default_factory=DataColumns)
    # How long: `max_steps`, else `epochs` passes over the data, else a budget of steps (`budget_steps`,
    # None = the method's in METHOD_DEFAULTS); with a dev file, early stopping after `patience`
    # evaluations without a better checkpoint (0 = off).
    epochs: int | None = None
    max_steps: int | None = None
    budget_steps: int | None = None
    patience: int = 2
    batch_size: int | None = None  # None: the method's
    grad_accum: int | None = None  # None: the method's
    lr: float | None = None  # None: the method's
    weight_decay: float = 0.0
    warmup_ratio: float = 0.05
    schedule: str = "cosine"
    max_grad_norm: float = 1.0
    mixed_precision: str = "no"
    dtype: str = "float32"
    quantization_bit: int = 0
    quantize_embedding: bool = False  # the frozen embedding and head in INT8 (`quant.apply.quantize_embedding`)
    gradient_checkpointing: bool = False
    # torch.compile backend of each decoder layer (`--compile`: COMPILE_BACKEND); None = eager
    compile: str | None = None
    # Several examples a row of up to max_len tokens, none seeing another (`batches.pack`). Off: on a CPU the tiny
    # model trained the shipped SPO set slower packed than unpacked, its rows grouped by length already (figures:
    # bench/results/kernel-notes.md).
    packing: bool = False
    seed: int = 42
    eval_every: int | None = None  # steps; None = EVALUATIONS times over the run
    save_every: int | None = None  # steps; the state is also saved at each evaluation and at the end
    eval_batch_size: int = 32
    log_every: int = 10
    tensorboard: bool = False
    threads: int | None = None  # torch intra-op threads; None = torch's default
    tiny_layers: int | None = None  # decoder layers of a tiny model built from scratch; None = its preset's

    def __post_init__(self):
        problems = []
        for name, allowed in (("tuning", TUNINGS), ("schedule", SCHEDULES), ("mixed_precision", MIXED_PRECISIONS),
                              ("dtype", LOAD_DTYPES)):
            if getattr(self, name) not in allowed:
                problems.append(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.quantization_bit not in (0, *QUANTIZATION_BITS):
            problems.append(f"quantization_bit must be 0, 4 or 8, got {self.quantization_bit}")
        if self.quantization_bit and self.tuning == "full":
            problems.append("full fine-tuning cannot update INT8/INT4 weights: use ptuning or lora on a quantized base")
        if self.quantize_embedding and self.tuning == "full":
            problems.append("full fine-tuning trains the embedding: quantize_embedding is for ptuning or lora")
        for name in ("epochs", "max_steps", "budget_steps", "batch_size", "grad_accum", "pre_seq_len",
                     "eval_batch_size", "log_every", "eval_every", "tiny_layers"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.tiny_layers is not None and self.tiny_layers > TINY_MAX_LAYERS:
            problems.append(f"tiny_layers must be at most {TINY_MAX_LAYERS} (a tiny model's depth), got "
                            f"{self.tiny_layers}")
        if self.compile is not None and not self.compile.strip():
            problems.append("compile names a torch.compile backend (e.g. inductor), got an empty string")
        if self.patience < 0:
            problems.append(f"patience must be >= 0 (0 = no early stopping), got {self.patience}")
        if self.save_every is not None and self.save_every < 1:
            problems.append(f"save_every must be >= 1, got {self.save_every}")
        if threads_problem(self.threads, "threads"):
            problems.append(threads_problem(self.threads, "threads"))
        if not 0 <= self.warmup_ratio < 1:
            problems.append(f"warmup_ratio is a share of the steps, in [0, 1), got {self.warmup_ratio}")
        for name in ("lr", "weight_decay", "max_grad_norm"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                problems.append(f"{name} must be >= 0, got {getattr(self, name)}")
        raise_problems(problems)

    @property
    def learning_rate(self) -> float:
        return self.lr if self.lr is not None else METHOD_DEFAULTS[self.tuning]["lr"]

    @property
    def rows_per_batch(self) -> int:
        return self.batch_size or METHOD_DEFAULTS[self.tuning]["batch_size"]

    @property
    def accumulation(self) -> int:
        """`grad_accum`, else the method's, which goes with the method's batch size: a batch size given
        alone is the whole optimizer step (`--batch-size 16` on P-tuning is 16 rows, not 16 x 16)."""
        if self.grad_accum:
            return self.grad_accum
        return 1 if self.batch_size else METHOD_DEFAULTS[self.tuning]["grad_accum"]

    def total_steps(self, steps_per_epoch: int) -> int:
        """Optimizer steps of the run: `max_steps`, else `epochs` passes, else the method's budget."""
        if self.max_steps:
            return self.max_steps
        if self.epochs:
            return self.epochs * steps_per_epoch
        return self.budget_steps or METHOD_DEFAULTS[self.tuning]["max_steps"]


EVALUATIONS = 5  # dev evaluations over a run, when --eval-every is not given


# The from-scratch demo: `--model tiny --tuning full` with no other flag trains with these. Its
# tokenizer is character-level, so an answer of three triples is ~45 tokens: the answer budget
# (max_len - max_src_len) is 80 instead of the 32 that suit ChatGLM-6B's word-level vocabulary.
# A budget of steps of 16 rows whatever the size of the set (TINY_DEMO_STEPS: 4.5 epochs of the shipped
# 10,000 records, 20 of a 2,200-record set), cut short by early stopping. Weight decay 0.1, lr 4e-3 and the
# model's dropout (config.PRESETS["tiny"]) keep the small model from learning a small set by heart, and depth
# rather than width (3 layers of MLP 256 for the ChatGLM-6B preset's 2800 steps) learnt the domain sets best in
# about the time of a run of 2 wider layers: chosen in side-by-side runs (bench/training/domains.py has the
# no-flag runs; bench/training/demo.py times the README's demo as it stands, bench/results/demo.json; figures:
# bench/results/kernel-notes.md).
# On a shared machine, --threads 1: OpenMP threads that outnumber the free cores slow the tiny model down
# tenfold. The GLM presets keep 3200 steps of their 2-layer models.
# --model NAME: a random tiny model of that version
TINY_PRESETS = {"tiny": "chatglm", "tiny-chatglm3": "chatglm3", "tiny-glm4": "glm4", "tiny-glm4-0414": "glm4-0414",
                "tiny-glm-edge": "glm-edge", "tiny-glm4-moe": "glm4-moe", "tiny-glm47": "glm4-moe",
                "tiny-glm47-flash": "glm4-moe-lite", "tiny-glm5": "glm5", "tiny-glm51": "glm5", "tiny-glm52": "glm5",
                "tiny-glm53-flash": "glm53-flash"}
# Presets whose tokenizer carries another version's released chat template: GLM-4.7 is GLM-4.5's architecture with
# GLM-4.7-Flash's template form.
TINY_CHAT_TEMPLATES = {"tiny-glm47": "glm4-moe-lite", "tiny-glm51": "glm5.1", "tiny-glm52": "glm5.2"}
TINY_MAX_LAYERS = 64  # --tiny-layers at most: the presets have 2 or 3; a billion asked for memory that never was
TINY_DEMO = dict(batch_size=16, grad_accum=1, lr=4e-3, warmup_ratio=0.03, weight_decay=0.1,
                 max_src_len=160, max_len=240, threads=2)
# budget_steps of each preset
TINY_DEMO_STEPS = {"tiny": 2800, "tiny-chatglm3": 3200, "tiny-glm4": 3200, "tiny-glm4-0414": 3200,
                   "tiny-glm-edge": 3200, "tiny-glm4-moe": 3200, "tiny-glm47": 3200, "tiny-glm47-flash": 3200,
                   "tiny-glm5": 3200, "tiny-glm51": 3200, "tiny-glm52": 3200, "tiny-glm53-flash": 3200}


# Torch CPU threads a command takes at most, per CPU of the machine: more only take turns on the same cores, and
# each costs memory (`--threads 1000000000` had libgomp ask for 216 GB).
THREADS_PER_CPU = 4


def max_threads() -> int:
    """The most torch CPU threads `--threads` or OMP_NUM_THREADS may ask for: THREADS_PER_CPU times the CPUs."""
    return THREADS_PER_CPU * (os.cpu_count() or 1)


def threads_problem(threads: int | None, origin: str = "--threads") -> str | None:
    """Why a thread count given by `origin` cannot be used (below 1, or above `max_threads()`); None when it can."""
    if threads is None:
        return None
    if threads < 1:
        return f"{origin} must be >= 1, got {threads}"
    if threads > max_threads():
        return (f"{origin} must be at most {max_threads()} ({THREADS_PER_CPU} x the {os.cpu_count() or 1} CPUs of this "
                f"machine), got {threads}")
    return None


def threads_from_environment() -> int | None:
    """OMP_NUM_THREADS when the user set it to a positive integer (torch's own default follows it too)."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


GIVEN_THREADS = ("--threads", "OMP_NUM_THREADS")  # thread counts the user gave: taken as they are, never fitted


def choose_threads(flag: int | None, fallback: int | None, fallback_name: str) -> tuple[int | None, str]:
    """(torch CPU threads, where the number came from): `--threads`, else OMP_NUM_THREADS (what the user set
    in the environment wins over a preset or a run's record), else `fallback` (named `fallback_name`), else
    torch's default (None). ValueError (`threads_problem`) for a flag or an environment out of bounds; a run's
    recorded count was checked where it ran."""
    for threads, origin in ((flag, "--threads"), (threads_from_environment(), "OMP_NUM_THREADS"),
                            (fallback, fallback_name)):
        if threads is not None:
            problem = threads_problem(threads, origin) if origin in GIVEN_THREADS else None
            if problem:
                raise ValueError(problem)
            return threads, origin
    return None, "torch's default"


# Where the C++ CPU kernels are built and kept (`quant.inline_build`): this variable's folder, else the user's cache.
KERNEL_CACHE_ENV = "CHATGLM_TUNE_KERNELS"


def kernel_cache() -> Path:
    """The kernel cache folder: $CHATGLM_TUNE_KERNELS, else $XDG_CACHE_HOME/chatglm_tune/kernels (~/.cache/...)."""
    if os.environ.get(KERNEL_CACHE_ENV):
        return Path(os.environ[KERNEL_CACHE_ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "chatglm_tune" / "kernels"


def tiny_demo(preset: str) -> dict:
    """The settings `train.py --model PRESET --tuning full` trains with when no flag says otherwise."""
    return {**TINY_DEMO, "budget_steps": TINY_DEMO_STEPS[preset]}


# tiny-glm4's tokenizer: ranks of a byte-level BPE trained on the corpus (bytes, every character, then
# merges up to this many ranks), in GLM-4's rank-file format (`glm4_tokenizer.train_glm4_bpe`). 256: no
# merges past the characters (the vocabulary grows to hold each one) but TINY_WORD_PIECES' below, which hold
# no CJK character or digit, so a word in the text and in an answer are the same tokens: the demo's dev F1 is
# clearly higher than with 2000 ranks (figures: bench/results/kernel-notes.md).
TINY_CONTEXT = 512  # tokens of a tiny model's context at least (a run's max_len when longer)
TINY_GLM4_VOCAB = 256
# Word pieces a tiny GLM tokenizer learns past its characters, of text outside CJK and digits only (Latin
# words, runs of spaces, JSON punctuation; `tokenizing.word_runs`): Chinese and numbers stay one character a
# token, as above, while the tools' JSON in a system prompt shrinks. A prompt of the shipped tool set (three
# tools): ChatGLM3's 539 tokens character by character, 158 with these pieces; GLM-4's 573 and 309 (its
# official system prompt is Chinese).
TINY_WORD_PIECES = 128


@dataclass(frozen=True)
class SamplingOptions:
    """How the next token is chosen; the one place for the defaults of `generate` and `infer.py`.

    do_sample: False = greedy (the default: extraction is scored, and greedy output is reproducible).
    top_p: 0.95, the reference script's value. temperature: 0.95, the official ChatGLM value (the
    reference script does not fix one for ChatGLM); 0 means greedy. top_k: None = off.
    """

    do_sample: bool = False
    top_p: float = 0.95
    temperature: float = 0.95
    top_k: int | None = None

    def __post_init__(self):
        problems = []
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            problems.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            problems.append(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if self.top_k is not None and not (isinstance(self.top_k, int) and self.top_k >= 1):
            problems.append(f"top_k must be None or an integer >= 1, got {self.top_k!r}")
        raise_problems(problems, "invalid sampling options: ")

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0


DEFAULT_SAMPLING = SamplingOptions()
# The official chat(): do_sample, top_p 0.7, temperature 0.95, and transformers' default top_k of 50.
CHAT_SAMPLING = SamplingOptions(do_sample=True, top_p=0.7, temperature=0.95, top_k=50)
CHAT_MAX_LENGTH = 2048  # the official chat(): prompt + answer tokens
# The official chat() and stream_chat() of ChatGLM2-6B, ChatGLM3-6B and GLM-4-9B-chat: do_sample, top_p 0.8,
# temperature 0.8, transformers' default top_k of 50, max_length 8192 (prompt + answer tokens).
GLM_CHAT_SAMPLING = SamplingOptions(do_sample=True, top_p=0.8, temperature=0.8, top_k=50)
GLM_CHAT_MAX_LENGTH = 8192


@dataclass(frozen=True)
class DraftOptions:
    """Speculative greedy decoding with drafts looked up in a row's own tokens (prompt lookup); the one place
    for its defaults.

    Each step a row guesses its next tokens: the tokens that followed the latest earlier match of its last n
    tokens (n from `ngram_max` down to `ngram_min`) in its answer so far, in the answers of the run's last
    `pool_answers` finished rows (infer.py; the server guesses from each request's own tokens only, so one
    client's text never changes how fast another's comes), or in its prompt; one forward checks them all, and
    the row keeps the guesses the model agrees with plus the model's own next token. A row drafts
    `first_draft` tokens, then twice as many after a step that took all its guesses (up to `max_draft`), and
    one more than it took after a step that did not. Greedy ids are plain greedy's (sampled rows decode
    plainly). ngram_max 4: the most tokens a forward on the SPO dev set of 2, 3 and 4.
    Off by default: it pays only where checking k guesses costs little more than one token, which depends on the
    CPU, the model and the batch (a tiny model's step is bound by Python's bookkeeping; on AVX2-only cores every
    row of x costs its own `vpmaddubsw` products, only the weight's unpacking shared), and on the tiny model's
    pattern it was no faster at batch 1 and slower at batch 8 (bench/decode/speculative_full.py; figures:
    bench/results/kernel-notes.md).
    """

    max_draft: int = 8
    first_draft: int = 4
    ngram_max: int = 4
    ngram_min: int = 1
    pool_answers: int = 256
    auto: bool = False  # each step guesses only where guessing has been faster at its number of rows (`adaptive`)

    def __post_init__(self):
        problems = []
        if not (isinstance(self.max_draft, int) and self.max_draft >= 1):
            problems.append(f"max_draft must be an integer >= 1, got {self.max_draft!r}")
        if not (isinstance(self.first_draft, int) and 1 <= self.first_draft <= max(1, self.max_draft)):
            problems.append(f"first_draft must be an integer in [1, max_draft], got {self.first_draft!r}")
        if not (isinstance(self.ngram_min, int) and isinstance(self.ngram_max, int)
                and 1 <= self.ngram_min <= self.ngram_max):
            problems.append(f"need integers 1 <= ngram_min <= ngram_max, got {self.ngram_min!r}, {self.ngram_max!r}")
        if not (isinstance(self.pool_answers, int) and self.pool_answers >= 0):
            problems.append(f"pool_answers must be an integer >= 0, got {self.pool_answers!r}")
        raise_problems(problems, "invalid draft options: ")

    def capped(self, max_draft: int | None) -> "DraftOptions":
        """These options with at most `max_draft` guesses a forward (None: as they are)."""
        if max_draft is None:
            return self
        return replace(self, max_draft=max_draft, first_draft=min(self.first_draft, max_draft))


DEFAULT_DRAFTS = DraftOptions()
# infer.py --speculative: "on" (every greedy step guesses), "auto" (a step guesses where guessing has been faster at
# its number of live rows: measured while the run goes, `decoding.adaptive`), "off"
SPECULATION_MODES = ("auto", "on", "off")
SPECULATION = "auto"


@dataclass(frozen=True)
class ExtractionSettings:
    """Batching, length, sampling and prompt of an extraction run (infer.py's flags).

    `max_new_tokens` None: the answer budget the model was trained with (`encoding.answer_budget`,
    `<sop>`'s successors up to `<eop>`, as train.py's dev evaluation generates).
    """

    batch_size: int = 8
    max_new_tokens: int | None = None
    sampling: SamplingOptions = DEFAULT_SAMPLING
    seed: int | None = None  # record i samples with seed + i
    encoding: EncodingOptions = field(default_factory=EncodingOptions)
    free_text: bool = False  # prompt/response data: answers are free text, not parsed as triples
    drafts: DraftOptions | None = None  # greedy decoding checks guesses (speculative, infer.py --speculative)
    compiled: bool = False  # decode steps compiled over a static cache (decoding.static_decoding, infer.py --compile)

    def __post_init__(self):
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def new_tokens(self) -> int:
        return self.max_new_tokens or self.encoding.answer_budget


# serve.py --max-batch at most: far above the rows a decoding step gains from, and the compiled slot cache holds a
# key and value buffer for every one of them.
MAX_BATCH_LIMIT = 4096


@dataclass(frozen=True)
class ServingOptions:
    """How serve.py batches (`engine.Engine`) and where it listens; the one place for its defaults.

    max_batch: requests decoded together at most (1 = one at a time, as the official demos serve).
    max_queue: requests waiting beyond the batch at most; more are refused (HTTP 429).
    prefill_tokens: prompt tokens prefilled at most per step, so newcomers stall running streams for one
    such prefill at a time (a longer prompt goes in chunks of this many tokens, where the model allows).
    512: of 64, 256 and 512 on a mid-size GLM-4, the best throughput and latencies together
    (bench/serve/serve.py; figures: bench/results/kernel-notes.md).
    drafts: greedy requests decode speculatively (`DraftOptions`: the same tokens, fewer forwards; off by
    default, see `DraftOptions`).
    compiled: the running batch decodes in fixed buffers, each step one compiled function (`slot_cache`; CUDA
    graphs on a GPU, where an eager step launches hundreds of kernels); models with a static cache only, and not
    with drafts. Off by default: on a CPU it compiles for each new shape and gains a small model's Python overhead.
    max_body_mb: a request body over this many MB (2**20 bytes) gets 413 unread: a chat of GLM-4's 128k-token
    context is well under 1 MB of text, and a body is held and parsed whole.
    cors_origins: the browser origins (`https://ui.example`, or "*") whose pages may call the server (CORS
    headers); none: no CORS headers, as before.
    """

    max_batch: int = 32  # at most MAX_BATCH_LIMIT
    max_queue: int | None = 256
    prefill_tokens: int = 512
    drafts: DraftOptions | None = None  # greedy requests check guesses (speculative, serve.py --speculative)
    compiled: bool = False  # compiled steps on a slot cache (serve.py --compile)
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_mb: float = 8.0
    cors_origins: tuple[str, ...] = ()

    def __post_init__(self):
        problems = []
        if not (isinstance(self.max_batch, int) and 1 <= self.max_batch <= MAX_BATCH_LIMIT):
            problems.append(f"max_batch must be an integer in [1, {MAX_BATCH_LIMIT}], got {self.max_batch!r}")
        if not (isinstance(self.port, int) and 0 <= self.port <= 65535):
            problems.append(f"port must be an integer in [0, 65535] (0: any free one), got {self.port!r}")
        if self.max_queue is not None and not (isinstance(self.max_queue, int) and self.max_queue >= 0):
            problems.append(f"max_queue must be None or an integer >= 0, got {self.max_queue!r}")
        if not (isinstance(self.prefill_tokens, int) and self.prefill_tokens >= 1):
            problems.append(f"prefill_tokens must be an integer >= 1, got {self.prefill_tokens!r}")
        if self.drafts is not None and self.drafts.auto:
            problems.append("drafts: the server's speculation is on or off (auto is infer.py's)")
        if self.compiled and self.drafts is not None:
            problems.append("compiled serving and speculative drafts do not combine: ask for one of them")
        if not (isinstance(self.max_body_mb, (int, float)) and self.max_body_mb > 0):
            problems.append(f"max_body_mb must be a number > 0, got {self.max_body_mb!r}")
        if not (isinstance(self.cors_origins, tuple) and all(isinstance(o, str) and o for o in self.cors_origins)):
            problems.append(f"cors_origins must be a tuple of origins, got {self.cors_origins!r}")
        raise_problems(problems, "invalid serving options: ")
