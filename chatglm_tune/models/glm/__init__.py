"""ChatGLM2-6B, ChatGLM3-6B and GLM-4-9B: transformers' GlmForCausalLM with the P-tuning prefix, the
official checkpoint layout, two tokenizers and three prompt formats."""
