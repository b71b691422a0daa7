"""A merged model as a transformers-native directory: what plain transformers, vLLM, SGLang and TGI load.

ChatGLM2/3, GLM-4 and GLM-Edge become transformers' own `GlmForCausalLM` (`model_type: glm`, as the released
`glm-4-9b-chat-hf` and GLM-Edge are), GLM-4-0414 its `Glm4ForCausalLM` (`model_type: glm4`, as released), GLM-4.5 /
4.6 / 4.7 its `Glm4MoeForCausalLM`, GLM-4.7-Flash its `Glm4MoeLiteForCausalLM`, GLM-5 its `GlmMoeDsaForCausalLM`
(the sparse attention's indexer under transformers' keys, `self_attn.indexer.*`, in the layers that have one) and
GLM-5.3-Flash its `Glm5NextForConditionalGeneration` (the composite config.json, its vision encoder's config as read:
the text model's weights, which transformers builds the vision encoder beside, randomly initialised, for text):
- config.json in transformers' fields (`config.transformers_form`, without the toolkit's own), plus `rope_theta`
  and `partial_rotary_factor` at the top level, where transformers 4 reads them;
- generation_config.json: the version's stop ids as `eos_token_id`, the export's sampling (greedy for a train.py
  run, the official chat()'s for a model directory: export/answering.py);
- safetensors under transformers' keys (q/k/v apart, `gate_up_proj` fused), the routed experts of the
  mixture-of-experts versions one by one as they are released (`mlp.experts.E.{gate,up,down}_proj.weight`, which
  transformers fuses as it loads), GLM-5.3-Flash's layers under their released names (`next_weights.released_layout`);
- the tokenizer as `tokenizer.json` (a `PreTrainedTokenizerFast`, left padding, the version's prefix, `[gMASK]` and
  the start token, put first by its post-processor; GLM-Edge has none and its post-processor adds nothing) and
  the version's Jinja chat template in tokenizer_config.json (with a run's instruction and the toolkit's render
  defaults, GLM-4.5's and GLM-4.7-Flash's thinking off unless asked: export/answering.py).
Loading needs no remote code and no `import chatglm_tune`.

The tokenizer.json of ChatGLM2/3 is their SentencePiece model in `tokenizers` terms: each text piece between
special tokens gets SentencePiece's "▁" in front and spaces become "▁" (SentencePiece's identity normalization
with its dummy prefix), then the same pieces: a Unigram model with the pieces' scores, or for a BPE model
(the real ChatGLM2/3 one) a BPE whose merges are ranked by the merged piece, both falling back to bytes.
GLM-4's (and GLM-4-0414's, GLM-Edge's) is its own byte-level BPE (`tokenizers`), as the toolkit runs it.

ChatGLM-6B has no transformers-native class: its directory is the official layout (official keys and
config.json, `ice_text.model`), which the official remote code and this toolkit load.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from chatglm_tune.data.tokenizing import SPIECE, adds_dummy_prefix, sentencepiece_model_type
from chatglm_tune.export.answering import engine_fields, template_defaults
from chatglm_tune.models.glm.config import transformers_form
from chatglm_tune.models.glm.next_weights import released_layout
from chatglm_tune.options import SamplingOptions
from chatglm_tune.runtime import checkpoint


def write_hf(out: Path, model, tokenizer, *, max_shard_bytes: int = 2 << 30, chat_template: str | None = None,
             sampling: SamplingOptions | None = None,
             progress: Callable[[int, int], None] = lambda done, total: None) -> dict:
    """Write the model and tokenizer of any version into the new directory `out`; {"files": [...]}.
    `chat_template`: the Jinja template of tokenizer_config.json (None: the version's); `sampling`: the defaults of
    generation_config.json (None: the official chat()'s). `progress(bytes written, bytes of the weights)` is called
    before the weights and as they are written."""
    out.mkdir(parents=True, exist_ok=True)
    if not hasattr(model.config, "chatglm_version"):  # ChatGLM-6B: the official layout
        size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        progress(0, size)
        model.save_pretrained(out, max_shard_bytes=max_shard_bytes)
        progress(size, size)
        tokenizer.save_pretrained(out)
    else:
        default = template_defaults(tokenizer.prompt_format) + tokenizer.prompt_format.chat_template(tokenizer)
        _write_glm(out, model, tokenizer, max_shard_bytes, progress, chat_template or default,
                   sampling or tokenizer.prompt_format.chat_sampling)
    return {"files": sorted(p.name for p in out.iterdir())}


def _write_glm(out: Path, model, tokenizer, max_shard_bytes: int, progress: Callable[[int, int], None],
               chat_template: str, sampling: SamplingOptions) -> None:
    state = released_layout(model.state_dict())  # as released (a P-tuning prefix never reaches export)
    checkpoint.save_state_dict(state, out, max_shard_bytes=max_shard_bytes, progress=progress)
    config = transformers_form(model.config, next(iter(state.values())).dtype, toolkit_fields=False)
    _write_json(out / "config.json", config)
    # greedy is do_sample false with temperature 0: vLLM reads the temperature alone (transformers notes that it
    # ignores a temperature when not sampling)
    _write_json(out / "generation_config.json", {
        "eos_token_id": list(tokenizer.stop_token_ids), "pad_token_id": tokenizer.pad_token_id,
        "do_sample": not sampling.greedy, **engine_fields(sampling)})
    backend = _sentencepiece_backend(tokenizer) if hasattr(tokenizer, "sp_model") else _glm4_backend(tokenizer)
    names = {i: t for t, i in tokenizer.special_ids.items()}
    prefix = [names[i] for i in tokenizer.get_prefix_tokens()]  # "[gMASK] sop" / "[gMASK] <sop>"; GLM-Edge: none
    if prefix:
        start = " ".join(prefix)
        backend.post_processor = processors.TemplateProcessing(
            single=f"{start} $A", pair=f"{start} $A $B",
            special_tokens=[(names[i], i) for i in tokenizer.get_prefix_tokens()])
    else:  # whatever the source's tokenizer.json adds, this one adds no token (byte-level offsets only)
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    backend.save(str(out / "tokenizer.json"))
    specials = sorted(tokenizer.special_ids.items(), key=lambda item: item[1])
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "padding_side": "left", "clean_up_tokenization_spaces": False,
        "eos_token": tokenizer.eos_token, "pad_token": tokenizer.pad_token, "unk_token": tokenizer.unk_token,
        "additional_special_tokens": [t for t, _ in specials if t not in (tokenizer.eos_token, tokenizer.pad_token)],
        "model_max_length": model.config.max_position_embeddings,
        "chat_template": chat_template})


def _glm4_backend(tokenizer) -> Tokenizer:
    return Tokenizer.from_str(tokenizer._backend.to_str())  # a copy: the post-processor is set on it


def _sentencepiece_backend(tokenizer) -> Tokenizer:
    sp = tokenizer.sp_model
    n = sp.get_piece_size()
    pieces = [(sp.id_to_piece(i), sp.get_score(i)) for i in range(n)]
    if sentencepiece_model_type(sp) == "bpe":
        vocab = {piece: i for i, (piece, _) in enumerate(pieces)}
        model = models.BPE(vocab, bpe_merges(vocab), unk_token=sp.id_to_piece(sp.unk_id()), fuse_unk=True,
                           byte_fallback=True)
    else:
        model = models.Unigram(pieces, unk_id=sp.unk_id(), byte_fallback=True)
    backend = Tokenizer(model)
    dummy_prefix = adds_dummy_prefix(sp)
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPIECE,
                                                     prepend_scheme="always" if dummy_prefix else "never", split=False)
    backend.decoder = decoders.Sequence([decoders.Replace(SPIECE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                         *([decoders.Strip(" ", 1, 0)] if dummy_prefix else [])])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, _ in sorted(tokenizer.special_ids.items(), key=lambda item: item[1])])
    return backend


def bpe_merges(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """The merges of a SentencePiece BPE model: every split of a piece into two pieces, ranked by the merged
    piece (SentencePiece orders a BPE model's pieces by the merge that made them), then by the parts."""
    merges = []
    for piece, rank in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((rank, vocab[left], vocab[right], left, right))
    return [(left, right) for *_, left, right in sorted(merges)]


def _write_json(path: Path, data: dict) -> None:
    checkpoint.atomic_write(path, lambda p: Path(p).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n",
                                                               encoding="utf-8"))
