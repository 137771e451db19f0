"""Checkpoint formats and loaders, in one place
(real_model, what_the_heads_read and model_of_today).

- safetensors: the model hub's tensor file, read and written with numpy alone;
- gpt2: GPT-2 in the hub's layout (config.json + model.safetensors);
- llama: Llama-architecture models in the hub's layout (SmolLM2's float checkpoint, a
  transformers LlamaForCausalLM saved with save_pretrained), with the half-split rotary
  pairing their q and k rows expect;
- gguf: llama.cpp's GGUF files (read with its gguf package), dequantized once to float32,
  with the interleaved pairing their reordered rows expect;
- smollm2: SmolLM2-135M-Instruct from the package registry, offline;
- gemma3: Gemma 3 270M from the package registry, offline (the Gemma Terms of Use
  apply), as Gemma3Params that kvlib.gemma3 runs (not kvlib Params: its sliding and
  global layers are not in kvlib's own loop yet);
- download: the model hub's files, for users with a network (never called by tests); without
  one it says "no network" at once;
- integrity: the checks that what loads is what kvlib fetched or wrote (a GGUF file's sha256,
  a converted folder's manifest of sha256s), a damaged file named with what to do.

Each turns a file into kvlib Params; kvlib.forward, prefill, decode_step and generate run
them all with the same loop.
"""
