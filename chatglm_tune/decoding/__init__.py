"""Decoding: from a prompt's ids to the answer's, for one caller or many at once.

The walk of a request: `serve/` tokenizes it and hands a `request.Request` to the `engine.Engine`; the
engine's `scheduler` admits it into the running batch, the batch's KV cache (`batch_cache`) takes its
prefill and one token a step through the forwards of `steps`, and the `emitter` samples each row's token
(`sampling`) and hands it back to the request, until a stop id or the budget ends it.
`generation.generate` takes the same steps for one batch of prompts (infer.py, training's evaluation,
`chat.chat`, the official `model.chat()`).
"""
