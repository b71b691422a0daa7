"""OpenAI-compatible HTTP serving of a model or run directory on the continuous-batching engine
(`chatglm_tune.decoding.engine`): `protocol` (requests, errors, responses), `service` (prompts, decoding, text),
`app` (the routes), `page.html` (the chat page). Needs the `serve` extra: `pip install -e ".[serve]"`."""
