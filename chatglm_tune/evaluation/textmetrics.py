"""Generation metrics for answers that are not SPO triples: the official ChatGLM P-tuning scores plus
exact match.

The official `ptuning/main.py` (THUDM/ChatGLM-6B and THUDM/ChatGLM2-6B, `compute_metrics`) scores
every prediction/label pair, then reports the mean of each score over the set:

    hypothesis, reference = list(jieba.cut(pred)), list(jieba.cut(label))          # words
    rouge-1/2/l: Rouge().get_scores(' '.join(hypothesis), ' '.join(reference))[0][key]["f"]
    bleu-4:      sentence_bleu([list(label)], list(pred), smoothing_function=SmoothingFunction().method3)
    each score of a pair: round(score * 100, 4); the set's score: the mean of those (not rounded again)

So ROUGE is over jieba words and BLEU-4 over characters. rouge_chinese's ROUGE-1/2 count distinct
n-grams (sets), its ROUGE-L is the longest common subsequence of the two whole word sequences, and
each F is 2PR / (P + R + 1e-8). Later official demos (ChatGLM3 `finetune_hf.py`, GLM-4 `finetune.py`) compute BLEU over
jieba words and leave it unscaled; we follow the P-tuning v2 scripts of ChatGLM-6B/ChatGLM2-6B.

Where the official code stops: rouge_chinese raises "Hypothesis is empty." (or "Reference is empty.")
when a side has no word (an empty or blank string). Here the three ROUGE scores of such a pair are
0.0 (the guard the common ChatGLM fine-tuning toolkits add, e.g. LLaMA-Factory); nltk already gives
BLEU 0 for an empty prediction.

`exact_match` is the fraction (0..1, not scaled) of pairs whose stripped strings are equal.

jieba, rouge-chinese and nltk are optional (SPO data needs none of them): they are imported on first
use, and a clear ImportError says how to install them.
"""

from __future__ import annotations

from typing import Iterable

ROUGE_KEYS = ("rouge-1", "rouge-2", "rouge-l")
KEYS = ROUGE_KEYS + ("bleu-4", "exact_match")
INSTALL_HINT = "pip install jieba rouge-chinese nltk"


def _tools():
    """(jieba.cut, rouge_chinese.Rouge, nltk sentence_bleu, SmoothingFunction().method3), imported lazily."""
    try:
        import jieba
        from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu
        from rouge_chinese import Rouge
    except ImportError as err:
        raise ImportError(
            f"the generation metrics (ROUGE, BLEU-4) need jieba, rouge-chinese and nltk ({err}): {INSTALL_HINT}"
        ) from err
    import logging

    jieba.setLogLevel(logging.WARNING)  # silence "Building prefix dict ..." on stderr
    return jieba.cut, Rouge, sentence_bleu, SmoothingFunction().method3


class GenerationScorer:
    """Accumulates prediction/reference pairs one at a time (inference streams); `result()` gives the means."""

    def __init__(self):
        self._cut, self._rouge, self._bleu, self._smoothing = _tools()
        self.count = 0
        self.sums = dict.fromkeys(KEYS, 0.0)

    def add(self, prediction: str, reference: str) -> dict[str, float]:
        """Score one pair; returns its scores (ROUGE/BLEU x 100 rounded to 4 places, exact match 0 or 1)."""
        hypothesis, words = list(self._cut(prediction)), list(self._cut(reference))
        if " ".join(hypothesis).split() and " ".join(words).split():
            rouge = self._rouge().get_scores(" ".join(hypothesis), " ".join(words))[0]
            scores = {key: round(rouge[key]["f"] * 100, 4) for key in ROUGE_KEYS}
        else:  # rouge_chinese raises on a side without words; the official code has no guard
            scores = dict.fromkeys(ROUGE_KEYS, 0.0)
        bleu = self._bleu([list(reference)], list(prediction), smoothing_function=self._smoothing)
        scores["bleu-4"] = round(float(bleu) * 100, 4)
        scores["exact_match"] = float(prediction.strip() == reference.strip())
        self.count += 1
        for key, value in scores.items():
            self.sums[key] += value
        return scores

    def result(self) -> dict[str, float]:
        """The mean of each score over the pairs added; ValueError when none was."""
        if not self.count:
            raise ValueError("no prediction/reference pair to score")
        return {key: self.sums[key] / self.count for key in KEYS}


def generation_scores(predictions: Iterable[str], references: Iterable[str]) -> dict[str, float]:
    """`{"rouge-1", "rouge-2", "rouge-l", "bleu-4", "exact_match"}` of `predictions[i]` against
    `references[i]` (both lists of strings, same length), as the module docstring defines them."""
    scorer = GenerationScorer()
    for prediction, reference in zip(predictions, references, strict=True):
        scorer.add(prediction, reference)
    return scorer.result()


def format(scores: dict[str, float]) -> str:
    """One line: `rouge-1 12.3456  rouge-2 ...  rouge-l ...  bleu-4 ...  exact_match 0.2500`."""
    return "  ".join(f"{key} {scores[key]:.4f}" for key in KEYS)
