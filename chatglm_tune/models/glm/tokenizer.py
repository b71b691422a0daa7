"""What every ChatGLM2/3 and GLM-4 tokenizer shares (`GLMFamilyTokenizer`): special tokens by their
official text, the `[gMASK] sop` (GLM-4: `<sop>`) prefix of every encode, and the official left padding
with 1D positions (`left_pad`). The SentencePiece tokenizers are in `sp_tokenizer.py`, GLM-4's in
`glm4_tokenizer.py`; `versions.load_glm_tokenizer` loads either from a directory.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizer
from transformers.utils import PaddingStrategy

from chatglm_tune.data.tokenizing import pair_inputs, special_tokens_mask


GLM_SPECIALS = ("[MASK]", "[gMASK]", "[sMASK]", "sop", "eop")
ROLES = ("system", "user", "assistant", "observation")
ROLE_SPECIALS = tuple(f"<|{role}|>" for role in ROLES)


def left_pad(
    encoded_inputs,
    pad_token_id: int,
    max_length: int | None,
    padding_strategy: PaddingStrategy,
    pad_to_multiple_of: int | None,
    padding_side: str | None,
) -> dict:
    """The official `_pad` of ChatGLM2/3 and GLM-4 for one row: `attention_mask` [s] (1 = token) and
    `position_ids` [s] (0..n-1 on the tokens) are added when missing, then the row is padded on the
    left with `pad_token_id`, 0 in both."""
    if padding_side not in (None, "left"):
        raise ValueError(f"GLM prompts must be left-padded, got padding_side={padding_side!r}")
    ids = list(encoded_inputs["input_ids"])
    if padding_strategy == PaddingStrategy.LONGEST:
        max_length = len(ids)
    if max_length is not None and pad_to_multiple_of is not None and max_length % pad_to_multiple_of:
        max_length = (max_length // pad_to_multiple_of + 1) * pad_to_multiple_of
    if "attention_mask" not in encoded_inputs:
        encoded_inputs["attention_mask"] = [1] * len(ids)
    if "position_ids" not in encoded_inputs:
        encoded_inputs["position_ids"] = list(range(len(ids)))
    if padding_strategy != PaddingStrategy.DO_NOT_PAD and max_length is not None and len(ids) < max_length:
        n_pad = max_length - len(ids)
        encoded_inputs["input_ids"] = [pad_token_id] * n_pad + ids
        for key, fill in (("attention_mask", 0), ("position_ids", 0), ("special_tokens_mask", 1)):
            if key in encoded_inputs:
                encoded_inputs[key] = [fill] * n_pad + list(encoded_inputs[key])
    return encoded_inputs


class GLMFamilyTokenizer(PreTrainedTokenizer):
    """What every ChatGLM2/3 and GLM-4 tokenizer shares: its special tokens by text (`special_ids`, set by
    the subclass), and the official left padding with 1D positions (`left_pad`)."""

    model_input_names = ["input_ids", "attention_mask", "position_ids"]
    padding_side = "left"
    special_ids: dict[str, int]
    prefix_texts: tuple[str, str] = ("[gMASK]", "sop")  # what every encode starts with (GLM-4: <sop>)

    def get_prefix_tokens(self) -> list[int]:
        return [self.get_command(t) for t in self.prefix_texts]

    def _cleaned(self, text: str, clean_up_tokenization_spaces: bool | None) -> str:
        """A decode's text, with transformers' clean-up where asked (None: the tokenizer's setting)."""
        clean = (self.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None
                 else clean_up_tokenization_spaces)
        return self.clean_up_tokenization(text) if clean else text

    def build_inputs_with_special_tokens(self, token_ids_0: list[int],
                                         token_ids_1: list[int] | None = None) -> list[int]:
        """`[gMASK] sop a`, or `[gMASK] sop a b <eos>` for a pair (official)."""
        return pair_inputs(self.get_prefix_tokens() + token_ids_0, token_ids_1, self.eos_token_id)

    def get_special_tokens_mask(self, token_ids_0, token_ids_1=None, already_has_special_tokens=False) -> list[int]:
        if already_has_special_tokens:
            return [int(i in self.special_token_ids) for i in token_ids_0]
        return special_tokens_mask(self.build_inputs_with_special_tokens, token_ids_0, token_ids_1)

    def get_command(self, token: str) -> int:
        """The id of a special token by its official text (`"[gMASK]"`, `"sop"`, `"<|user|>"`)."""
        if token not in self.special_ids:
            raise KeyError(f"{token!r} is not a special token of {type(self).__name__}")
        return self.special_ids[token]

    @property
    def special_token_ids(self) -> frozenset[int]:
        return frozenset(self.special_ids.values())

    def _pad(self, encoded_inputs, max_length=None, padding_strategy=PaddingStrategy.DO_NOT_PAD,
             pad_to_multiple_of=None, padding_side=None, return_attention_mask=None) -> dict:
        return left_pad(encoded_inputs, self.pad_token_id, max_length, padding_strategy,
                        pad_to_multiple_of, padding_side)
