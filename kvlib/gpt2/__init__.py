"""GPT-2 in kvlib (real_model and what_the_heads_read): its weights, its tokenizer, and the file
format, under one name. The code lives with the other checkpoint formats in kvlib.checkpoints and
with SmolLM2's tokenizer in kvlib.bpe; kvlib/gpt2/data/ holds GPT-2's vocabulary files.

- `load(directory, dtype)` turns a GPT-2 checkpoint folder (the model hub's layout:
  config.json + model.safetensors) into kvlib params, memory-mapped; `save` writes one.
  kvlib.forward, prefill, decode_step and generate run them like the toy.
- `download()` fetches GPT-2 124M where a network exists; `find_weights()` finds it again.
- `Tokenizer.gpt2()` is GPT-2's byte-level BPE tokenizer, built from the vocabulary shipped
  in kvlib/gpt2/data/ (OpenAI's files; see LICENSE there).
- `read_safetensors` and `write_safetensors` read and write the safetensors format with
  numpy alone.

Needs numpy and regex; no torch. Only download() needs a network (and huggingface_hub).
"""

from ..bpe import (
    END_OF_TEXT,
    PRETOKENIZER_PATTERN,
    Tokenizer,
    bytes_to_unicode,
    load_tokenizer,
)
from ..checkpoints.download import default_directory, download, find_weights
from ..checkpoints.gpt2 import GPT2_124M, config_from_hub, load, save
from ..checkpoints.safetensors import (
    DTYPES,
    bfloat16_to_float32,
    float32_to_bfloat16,
    read_header,
    read_safetensors,
    write_safetensors,
)
