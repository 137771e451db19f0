"""GPT-2 in kvlib (issue 9; notebook 12): its tokenizer and the file format of its weights.

`kvlib.gpt2.Tokenizer.gpt2()` is GPT-2's byte-level BPE tokenizer, built from the vocabulary
shipped in kvlib/gpt2/data/ (OpenAI's files; see LICENSE there). `read_safetensors` and
`write_safetensors` read and write the safetensors format with numpy alone. Needs numpy and
regex; no torch, no network.
"""

from .safetensors import (
    DTYPES,
    bfloat16_to_float32,
    float32_to_bfloat16,
    read_header,
    read_safetensors,
    write_safetensors,
)
from .tokenizer import (
    END_OF_TEXT,
    PRETOKENIZER_PATTERN,
    Tokenizer,
    bytes_to_unicode,
    load_tokenizer,
)
