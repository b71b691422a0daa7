"""chatglm.cpp 0.4.2's side of bench/peer/peer.py: whether it is installed, the GGML file it reads (written here from
an official-layout ChatGLM-6B or ChatGLM3-6B checkpoint), the threads it computes with, and its two measuring processes
(`convert-*`: write the file; `cpp-*`: greedy next-token decoding through its Python API, on the workload of
bench/peer/peer_children.py).

chatglm.cpp is optional, for this bench only (`INSTALL`); chatglm.cpp's own converter needs the official
remote code, which this checkout does not have, hence `write_ggml`.
"""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path

from bench.peer.peer_children import EXTRACT_NEW_TOKENS, NEW_TOKENS, PROMPT_LEN, WARMUP_PROMPT, WARMUP_TOKENS, prompt

CPP_TYPES = ("f16", "q8_0", "q4_0")  # the GGML files written and run
INSTALL = 'CMAKE_ARGS="-DCMAKE_POLICY_VERSION_MINIMUM=3.5" pip install chatglm-cpp==0.4.2'


def has_chatglm_cpp() -> bool:
    try:
        import chatglm_cpp  # noqa: F401
    except ImportError:
        return False
    return True


# ---------------------------------------------------------------------------------------------- GGML file


def _tiny_sentencepiece() -> bytes:
    """A serialized SentencePiece model with ChatGLM-6B's special pieces (chatglm.cpp's tokenizer looks them
    up); its ids never reach the model here, which is fed ids directly."""
    import sentencepiece as spm

    words = ["chatglm", "benchmark", "decode", "prefill", "memory", "tokens", "speed", "weights", "quantized", "layer"]
    lines = [" ".join(words[(i * 7 + j) % len(words)] for j in range(8)) for i in range(200)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=40,
                                   hard_vocab_limit=False, model_type="unigram",
                                   user_defined_symbols=["[MASK]", "[gMASK]", "<sop>", "<eop>"], pad_id=3, unk_id=0,
                                   bos_id=1, eos_id=2, minloglevel=2)
    return model.getvalue()


def _shard_reader(model_dir: Path):
    """key -> tensor of an official checkpoint (`.bin` or safetensors shards), one shard open at a time."""
    import torch
    from safetensors import safe_open

    index = next(model_dir / n for n in ("pytorch_model.bin.index.json", "model.safetensors.index.json")
                 if (model_dir / n).is_file())
    weight_map = json.loads(index.read_text())["weight_map"]
    shards: dict[str, dict] = {}

    def tensor(key: str):
        name = weight_map[key]
        if name not in shards:
            shards.clear()  # keys come shard by shard: keep one open
            path = model_dir / name
            shards[name] = (safe_open(path, "pt") if path.suffix == ".safetensors"
                            else torch.load(path, mmap=True, weights_only=True))
        shard = shards[name]
        return shard[key] if isinstance(shard, dict) else shard.get_tensor(key)

    return tensor


def write_ggml(out: Path, model_dir: Path, dtype: str, version: str = "chatglm") -> dict:
    """chatglm.cpp 0.4.2's file of `version` (ChatGLM-6B or ChatGLM3-6B) from an official-layout checkpoint,
    through the toolkit's writer (`chatglm_tune.export.ggml_file`), tensor by tensor: memory stays about one
    shard plus a tensor."""
    import torch

    from chatglm_tune.export.ggml_file import write_ggml as write

    config = json.loads((model_dir / "config.json").read_text())
    tensor = _shard_reader(model_dir)
    if version == "chatglm":
        head = tensor("lm_head.weight")
        assert torch.equal(head[:64], tensor("transformer.word_embeddings.weight")[:64]), "the head must be tied"
        proto = _tiny_sentencepiece()
    else:
        # a serialized SentencePiece model, as chatglm.cpp stores it
        proto = (model_dir / "tokenizer.model").read_bytes()
    return write(out, {"chatglm": 1, "chatglm3": 3}[version], config, tensor, proto, dtype)


# ---------------------------------------------------------------------------------------------- children


def child_convert(args) -> dict:
    start = time.perf_counter()
    info = write_ggml(Path(args.ggml), Path(args.model_dir), args.dtype, args.version)
    return {**info, "seconds": time.perf_counter() - start}


def cpp_threads() -> int:
    """The threads chatglm.cpp 0.4.2 computes with: its Python API has no setting; it takes the online CPUs
    (all of them up to 4, half beyond, at most 16), whatever the process's affinity. Pinning the process to
    fewer cores then runs that many spinning threads on them (measured here: a q4_0 run pinned to one core had not
    finished its 64 tokens after 9 minutes)."""
    n = os.cpu_count() or 4
    return min(n if n <= 4 else n // 2, 16)


def child_cpp(args) -> dict:
    import chatglm_cpp
    from chatglm_cpp import _C

    longest = max(args.prompt_len, PROMPT_LEN)  # the measured prompt (--prompt-len), the extraction record's
    start = time.perf_counter()
    pipe = chatglm_cpp.Pipeline(str(args.ggml), max_length=longest + NEW_TOKENS + 8)
    model = pipe.model
    load_s = time.perf_counter() - start
    config = _C.GenerationConfig(max_length=longest + NEW_TOKENS + 8, max_new_tokens=NEW_TOKENS,
                                 max_context_length=longest + 8, do_sample=False)

    def run(ids: list[int], new: int) -> tuple[list[float], list[int]]:
        """Greedy `new` tokens after `ids`: (the time of each call, the tokens), as 0.4.2's own loop feeds it."""
        ids, n_ctx, n_past, stamps, out = list(ids), len(ids), 0, [time.perf_counter()], []
        for _ in range(new):
            token = model.generate_next_token(ids, None, config, n_past, n_ctx)
            stamps.append(time.perf_counter())
            n_past = len(ids)
            ids.append(token)
            out.append(token)
        return stamps, out

    run(prompt(args.frame, WARMUP_PROMPT, 1)[0], WARMUP_TOKENS)
    stamps, out = run(prompt(args.frame, args.prompt_len, 0)[0], NEW_TOKENS)
    threads = len(os.listdir("/proc/self/task"))
    record, _ = run(prompt(args.frame, PROMPT_LEN, 2)[0], EXTRACT_NEW_TOKENS)
    return {"load_s": load_s, "prompt_len": args.prompt_len, "prefill_ms": (stamps[1] - stamps[0]) * 1e3,
            "decode_ms": (stamps[-1] - stamps[1]) / (NEW_TOKENS - 1) * 1e3, "record_s": record[-1] - record[0],
            "records_per_s": 1 / (record[-1] - record[0]), "distinct_tokens": len(set(out)), "first_tokens": out[:8],
            "os_threads": threads, "threads": cpp_threads()}
