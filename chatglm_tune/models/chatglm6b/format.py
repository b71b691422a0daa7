"""ChatGLM-6B's prompt format: how a record and a chat become ids, as its official code builds them.

Fine-tuning (`ptuning/main.py`): `encode(prompt + text)` cut to `max_src_len - 1` tokens, then `[gMASK]
<sop>`; the answer `encode(answer)` cut to its budget, then `<eop>`; `<sop>` is trained on too. A history
makes the text the official rounds (`chat_prompt`). Chat (`model.chat`): the same prompt of the query and
its (query, response) history, the answer post-processed by `process_response`.
"""

from __future__ import annotations

import re
from typing import Sequence

from chatglm_tune.data.batches import PromptFormat
from chatglm_tune.data.records import SPORecord
from chatglm_tune.options import CHAT_MAX_LENGTH, CHAT_SAMPLING, EncodingOptions

_PUNCTUATION = ((",", "，"), ("!", "！"), (":", "："), (";", "；"), (r"\?", "？"))
_CJK = r"[\u4e00-\u9fff]"
TRAINING_TIME = "2023年"  # what the official post-processing writes for the `[[训练时间]]` placeholder


def chat_prompt(query: str, history: Sequence[tuple[str, str]] | None) -> str:
    """ChatGLM-6B's multi-turn prompt: the query alone when `history` is None, else `[Round i]\n问：q\n答：r\n`
    for each earlier turn, then `[Round n]\n问：{query}\n答：`. The official `ptuning/main.py` builds the
    rounds whenever there is a history column (even an empty one); the official `chat()` only for a
    non-empty history."""
    if history is None:
        return query
    rounds = "".join(f"[Round {i}]\n问：{q}\n答：{r}\n" for i, (q, r) in enumerate(history))
    return rounds + f"[Round {len(history)}]\n问：{query}\n答："


def process_response(response: str) -> str:
    """ChatGLM-6B's official post-processing: strip, `[[训练时间]]` -> `2023年`, ASCII `, ! : ; ?` next to a
    CJK character made full-width."""
    response = response.strip().replace("[[训练时间]]", TRAINING_TIME)
    for ascii_mark, full_width in _PUNCTUATION:
        response = re.sub(rf"({_CJK}){ascii_mark}", rf"\g<1>{full_width}", response)
        response = re.sub(rf"{ascii_mark}({_CJK})", rf"{full_width}\g<1>", response)
    return response


class ChatGLM6BFormat(PromptFormat):
    name = "chatglm"
    title = "ChatGLM-6B"
    labelled_prompt_tokens = 1  # <sop>, which [gMASK] is trained to predict
    chat_sampling = CHAT_SAMPLING
    chat_max_length = CHAT_MAX_LENGTH
    chat_in_pairs = True
    stream_lookahead = 1  # process_response makes punctuation full-width by the character after it

    def prompt_ids(self, tokenizer, record: SPORecord, options: EncodingOptions) -> tuple[list[int], bool]:
        """`encode(prompt + text)` cut to `max_src_len - 1`, then `[gMASK] <sop>` (history: the official rounds)."""
        self.check_pairs(record)
        ids = tokenizer.encode(options.prompt + chat_prompt(record.text, record.history), add_special_tokens=False)
        kept = ids[: options.max_source_tokens]
        return kept + [tokenizer.gmask_token_id, tokenizer.bos_token_id], len(kept) < len(ids)

    def answer_ids(self, tokenizer, answer: str, options: EncodingOptions) -> tuple[list[int], bool]:
        ids = tokenizer.encode(answer, add_special_tokens=False)
        return ids[: options.max_answer_tokens] + [tokenizer.eos_token_id], len(ids) > options.max_answer_tokens

    def stop_ids(self, tokenizer) -> list[int]:
        return [tokenizer.eos_token_id]

    def chat_response(self, texts: list[str], query: str, history: list) -> tuple:
        response = process_response(texts[0])
        return response, [*history, (query, response)]


FORMAT = ChatGLM6BFormat()
