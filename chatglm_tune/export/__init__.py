"""Exporting a model or a train.py run into the engines people deploy with (`export.py`).

    source.py         what can be exported: a model directory, a full run, a LoRA run merged into its float
                      base; P-tuning runs and INT8/INT4 directories refused with the reason
    gguf_file.py      ChatGLM2/3, GLM-4 and GLM-Edge (llama.cpp's `chatglm`), GLM-4-0414 (`glm4`) as a GGUF file for
                      llama.cpp / ollama (tensors, hyperparameters)
    gguf_moe.py       GLM-4.5 / 4.6 / 4.7 (`glm4moe`), GLM-4.7-Flash (`deepseek2`) and GLM-5 (`glm-dsa`) in that
                      file: stacked experts, latent attention, the sparse attention's indexer, their hyperparameters
    gguf_vocab.py     the tokenizer inside that file (SentencePiece pieces, or the GLM-4 family's byte-level BPE)
    tensors.py        the tensors it is written from: a loaded model's, or a checkpoint's files streamed
    ollama.py         the ollama Modelfile beside it (the version's prompt as a Go template, its stops)
    ggml_file.py      chatglm.cpp's GGML file (ChatGLM-6B, which llama.cpp cannot run; ChatGLM2/3)
    hf_dir.py         a transformers-native directory (`GlmForCausalLM`, GLM-4-0414's `Glm4ForCausalLM`,
                      `Glm4MoeForCausalLM`, `Glm4MoeLiteForCausalLM`, `GlmMoeDsaForCausalLM`, tokenizer.json) for
                      transformers / vLLM

Each version declares what this needs as data: its Jinja / ollama chat templates and stop texts
(`PromptFormat`), its GGUF tensor names (`models.glm.weights.gguf_name`), the formats it cannot be written as
and its chatglm.cpp model type (`Version`). Needs the `export` extra (`pip install -e ".[export]"`: gguf-py) for the
GGUF and GGML files.
"""
