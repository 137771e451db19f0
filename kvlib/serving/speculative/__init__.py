"""Speculative decoding (speculative_decoding; Leviathan et al. 2023, Chen et al. 2023).

A decode step of a large model reads all of its weights to produce one token (where_time_goes);
a pass over k + 1 tokens reads them once too, and costs little more. So a small draft model
guesses the next k tokens with its own cached decode, and the target checks all k guesses in
one pass: a chunked prefill of the last token and the k guesses, continuing its cache (the
mask aligned to the end, the kv_cached_decode lesson). Its k + 1 rows of logits say what the target
itself would choose after each prefix. The guesses up to the first one the target rejects are kept,
then one token of the target's own (at the rejection, or a bonus token after the last row
when all k pass), and both caches are truncated back to what was kept (cache.truncate).

The pieces, one module a job (this package exports them all):

- drafters: ``propose``, the draft's k guesses and its distribution at each, (k,) and
  (k, V); a drafter is whatever proposes the guesses: ``ModelDrafter`` (a draft model and its cache;
  a kvlib Params given as the draft becomes one, and ``target.first_layers(n)`` makes the
  target's own first layers a draft: self-speculation) or ``PromptLookupDrafter`` (no model:
  the tokens that followed the last n-gram's earlier occurrence in the prompt and output,
  ``prompt_lookup``);
- acceptance: ``GreedyAcceptance``: keep a guess when it is the target's argmax. The output
  is exactly the target's own greedy tokens;
- ``SamplingAcceptance``: keep guess x with probability min(1, p(x) / q(x)), else draw the
  target's token from max(0, p - q), normalised (``acceptance_probability``,
  ``residual_distribution``). The output is distributed exactly as the target's samples;
- decoder: ``verify``, the target's k + 1 rows of logits in one pass; ``SpeculativeDecoder``,
  the loop, both caches, a ``SpeculativeStep`` record per round;
  ``speculative_generate`` is kvlib.generate's counterpart;
- expectations, what to expect: ``expected_tokens_per_pass(alpha, k)`` =
  (1 - alpha^(k+1)) / (1 - alpha), ``predicted_speedup(alpha, k, c)``,
  ``greedy_agreements`` and ``replay_greedy`` (the rounds greedy decoding will take, from
  where the draft agrees with the target), and ``outcome_probabilities``: the exact
  distribution of one step's outcome.
"""


from .acceptance import (
    PROBABILITY_TOLERANCE,
    GreedyAcceptance,
    SamplingAcceptance,
    Verdict,
    acceptance_probability,
    certain,
    residual_distribution,
)
from .decoder import (
    SpeculativeDecoder,
    SpeculativeStats,
    SpeculativeStep,
    speculative_generate,
    summarize,
    verify,
)
from .drafters import (
    Drafter,
    ModelDrafter,
    PromptLookupDrafter,
    Proposal,
    as_drafter,
    check_model,
    check_pair,
    check_speculation_length,
    prompt_lookup,
    propose,
)
from .expectations import (
    MAX_OUTCOME_PATHS,
    expected_tokens_per_pass,
    greedy_agreements,
    outcome_probabilities,
    predicted_speedup,
    replay_greedy,
)
