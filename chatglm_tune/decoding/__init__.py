"""Decoding: from a prompt's ids to the answer's, for one caller or many at once.

The walk of a request through serve.py: `serve/` tokenizes it and hands a `request.Request` to the
`engine.Engine`; the engine's `scheduler` admits it into the running batch, the batch's KV cache
(`batch_cache.BatchCache`) takes its prompt in one prefill and then one token a step, and the `emitter`
samples each row's next token (`sampling`) and hands it back to the request, until a stop id or the
budget ends it. `generation.generate` takes the same steps over one batch of prompts (infer.py's
extraction, training's evaluation), and `chat` is the official `model.chat()` / `stream_chat()` on it.
With speculation asked for, greedy rows guess their next tokens (`drafting`) and one forward checks every
row's guesses (`speculative` for `generate`, `emitter.Emitter.emit_verified` for the engine). `scoring` gives a
prompt's own token log probabilities (a completion's echoed prompt).
"""
