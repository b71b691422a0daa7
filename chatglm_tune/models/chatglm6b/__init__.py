"""ChatGLM-6B (v1): its own modeling (2D GLM positions, tied head), tokenizer, prompt format and config."""
