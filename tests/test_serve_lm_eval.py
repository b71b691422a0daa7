"""lm-eval (EleutherAI's harness) against serve.py: its `local-completions` model sends token-id prompts with `echo`,
`logprobs` 1 and `max_tokens` 1 and reads each continuation's log-likelihood from the echoed prompt's token
log probabilities. The per-choice log-likelihoods it gets equal the model's own forward over the same ids."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("starlette", reason='the server needs its extra: pip install -e ".[serve]"')
pytest.importorskip("uvicorn", reason='the server needs its extra: pip install -e ".[serve]"')
pytest.importorskip("tenacity", reason="lm-eval's API models need it: pip install 'lm_eval[api]'")
completions = pytest.importorskip("lm_eval.models.openai_completions",
                                  reason="the test runs lm-eval against the server: pip install 'lm_eval[api]'")

from lm_eval.api.instance import Instance  # noqa: E402
from serving import tiny_model  # noqa: E402
from test_serve import serving  # noqa: E402
from test_serve_client import Answers  # noqa: E402


def test_lm_evals_multiple_choice_loglikelihoods_are_the_models_own(tmp_path, monkeypatch):
    directory = tiny_model("glm4", tmp_path / "glm4")
    context, choices = "制动钳", ["异响", "漏油", "正常"]
    with serving(directory) as s:
        answers = Answers(s.service.engine, monkeypatch)
        lm = completions.LocalCompletionsAPI(base_url=f"{s.url}/v1/completions", model="tiny", tokenizer=str(directory),
                                             tokenizer_backend="huggingface", tokenized_requests=True, max_retries=1,
                                             num_concurrent=1, batch_size=3)
        got = lm.loglikelihood([Instance(request_type="loglikelihood", doc={}, arguments=(context, choice), idx=i)
                                for i, choice in enumerate(choices)], disable_tqdm=True)
        assert len(answers.prompts) == len(choices)
        for (loglikelihood, _), choice in zip(got, choices):
            prompt = next(p for p in answers.prompts
                          if p[len(p) - len(lm.tok_encode(choice)):] == lm.tok_encode(choice))
            with torch.no_grad():
                logits = s.model(input_ids=torch.tensor([prompt])).logits[0, :-1].float()
            logits[:, len(s.tokenizer):] = float("-inf")
            logprobs = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
            assert loglikelihood == pytest.approx(logprobs[-len(lm.tok_encode(choice)):].sum().item(), abs=1e-4)
