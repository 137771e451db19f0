"""Keys and values stored in a few bits (quantized_cache; KIVI, vLLM's --kv-cache-dtype).

Symmetric quantization: a group of numbers x shares one scale s = max|x| / q_max, with
q_max = 2**(bits - 1) - 1 (127 for int8, 7 for int4, 1 for int2). Each number is stored as
the whole number code = round(x / s), between -q_max and q_max, and read back as code x s:
the error of every number is at most s / 2, half a quantization step. Scales are stored in
float16, rounded up so that no number falls outside the codes. Codes of 4 and 2 bits are
packed two and four to a byte, so that nbytes counts what a real cache would hold.

Which numbers share a scale is the grouping, chosen for K and V separately:

- PerToken(bits, residual=0): one scale per cached row, a token's K (or V) in one layer,
  all K/V heads; with residual=R the newest R rows stay in full precision (KIVI's values);
- PerChannel(bits, group_size, residual=None): one scale per column over a group of G =
  group_size positions. The newest rows are kept in full precision until R = residual of
  them (a multiple of G, by default G) have arrived, then quantized G at a time (KIVI's
  keys).

KIVI itself (Liu et al., ICML 2024; github.com/jy-yuan/KIVI, models/llama_kivi.py) is
PerChannel(bits, G, R) for the keys with PerToken(bits, R) for the values, at 2 or 4 bits
with asymmetric codes (a zero point), and per-token groups of G channels within a row.

QuantizedKVCache(config, keys=..., values=...) stores K and V this way, and kvlib.prefill and
kvlib.decode_step run on it unchanged. Everything attention reads comes back through the
store: keys(layer) and values(layer) dequantize on read and return float arrays, in a
prefill as in a decode step (a real kernel fuses the dequantization into attention).

One module a job, this package exporting them all: codes (codes and scales, packing),
groupings (PerToken, PerChannel and how each stores rows), cache (QuantizedKVCache), sizes
(the bytes held), quality (what it does to the predictions), outliers (keys with outlier
channels).
"""


from .cache import QuantizedKVCache
from .codes import (
    BYTE_TABLES,
    SCALE_BYTES,
    SCALE_DTYPE,
    SUPPORTED_BITS,
    dequantize,
    max_code,
    pack_codes,
    packed_width,
    quantization_step,
    quantize,
    round_trip,
    symmetric_scales,
    unpack_codes,
)
from .groupings import PerChannel, PerChannelStore, PerToken, PerTokenStore
from .outliers import with_outlier_key_channels
from .quality import (
    Quality,
    decoded_logits,
    greedy_agreement,
    greedy_tokens,
    measure_quality,
    next_token_loss,
    plain_logits,
)
from .sizes import bytes_per_token, quantized_cache_bytes
