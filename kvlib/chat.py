"""Chat templates (model_of_today): how a conversation becomes the one text a model continues.

A chat model never sees "messages". It sees one text, in which each message is wrapped in
control tokens the model was fine-tuned on. SmolLM2 uses ChatML:

    <|im_start|>system
    You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
    <|im_start|>user
    What is 2+2?<|im_end|>
    <|im_start|>assistant

and the model's reply ends with <|im_end|>. The template that writes this ships inside the
model (the GGUF's tokenizer.chat_template, the hub's tokenizer_config.json) as a Jinja
template; ChatTemplate renders it with jinja2, in the sandbox and with the options
transformers' apply_chat_template uses, so that both give the same text.

The rendered text mixes two sources: the template's own markers and what people typed. If the
whole text were tokenized with its control tokens parsed, a message holding the text
"<|im_end|>\n<|im_start|>system\n..." would become a real system turn: the typed characters
would turn into the very ids the template writes. So kvlib marks every control token inside a
message (`mark_control_tokens`, between two Unicode noncharacters) before rendering, and the
tokenizer encodes what is marked as plain text (kvlib.bpe.Tokenizer.encode_marked). Only the
template's markers become control tokens. transformers 5.25 does the same with
`apply_chat_template(..., sanitize_control_tokens=True)`; by default it, and llama.cpp's
server, parse control tokens anywhere in the rendered text (`parse_special=True` gives that).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

from .checks import as_flag, as_instance, as_whole_number, as_whole_numbers

ROLES = ("system", "user", "assistant")

MARK_START, MARK_END = "\ufdd0", "\ufdd1"
"""What a control token typed inside a message is wrapped in before rendering: two Unicode
noncharacters, code points that no text exchanged between programs should hold (transformers
wraps them in private-use characters for the same purpose)."""


def control_token_pattern(control_tokens: Iterable[str]) -> re.Pattern:
    """A regular expression matching any of the control tokens, the longest first (so that
    a token is never cut by a shorter one inside it); it matches nothing for no tokens."""
    longest_first = sorted(set(control_tokens), key=len, reverse=True)
    return re.compile("|".join(map(re.escape, longest_first)) or "(?!)")


def encode_around(parts: Sequence[str], whole_ids: Mapping[str, int], encode_text
                  ) -> list[int]:
    """Ids of a text split by a pattern with one group (pattern.split(text)): the odd parts,
    the pattern's matches (control tokens, whole pieces), are looked up in whole_ids; the
    others, plain text, go through encode_text (the empty ones are skipped)."""
    ids = []
    for number, part in enumerate(parts):
        if number % 2:
            ids.append(whole_ids[part])
        elif part:
            ids.extend(encode_text(part))
    return ids


def mark_control_tokens(text: str, pattern: re.Pattern) -> str:
    """text with every control token (a match of pattern) wrapped in MARK_START ... MARK_END,
    so that the tokenizer reads it as plain text (model_of_today). Markers already in the text
    are dropped first, so that typed markers cannot mark, or unmark, anything."""
    text = text.replace(MARK_START, "").replace(MARK_END, "")
    return pattern.sub(lambda match: MARK_START + match.group(0) + MARK_END, text)


def check_messages(messages) -> list[dict[str, str]]:
    """messages as a list of {"role", "content"} dicts, or a clear error saying what is wrong."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not all(
            isinstance(m, Mapping) and set(m) == {"role", "content"} and m["role"] in ROLES
            and isinstance(m["content"], str) for m in messages):
        raise ValueError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, "
                         f"each role one of {ROLES} and each content text, got {messages!r:.200}")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


class ChatTemplate:
    """A model's chat template (model_of_today): render(messages) -> the text the model reads.

    template: the Jinja source as the model ships it. Rendered like transformers'
    apply_chat_template: in jinja2's immutable sandbox, with trim_blocks and lstrip_blocks,
    `raise_exception` available to the template, and add_generation_prompt=True opening the
    assistant's turn so that the model's next tokens are its reply.
    """

    def __init__(self, template: str, **special_tokens: str):
        self.source = template
        self.special_tokens = special_tokens
        self._compiled = None

    def __repr__(self) -> str:
        return f"ChatTemplate({len(self.source)} characters of Jinja)"

    def _template(self):
        if self._compiled is None:
            try:
                from jinja2.sandbox import ImmutableSandboxedEnvironment
            except ImportError:
                raise ImportError("rendering a chat template needs jinja2 (installed with "
                                  "JupyterLab): pip install jinja2") from None

            def raise_exception(message):
                raise ValueError(f"the chat template refused these messages: {message}")

            environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            environment.globals["raise_exception"] = raise_exception
            self._compiled = environment.from_string(self.source)
        return self._compiled

    def render(self, messages, add_generation_prompt: bool = True,
               mark: re.Pattern | None = None) -> str:
        """The text of a conversation: messages [{"role": "user", "content": "..."}, ...]
        -> one string; with add_generation_prompt the assistant's turn is opened. mark: a
        control_token_pattern; the control tokens inside every message's content are then
        wrapped in markers (mark_control_tokens) for Tokenizer.encode_marked."""
        messages = check_messages(messages)
        if mark is not None:
            messages = [{"role": m["role"], "content": mark_control_tokens(m["content"], mark)}
                        for m in messages]
        return self._template().render(messages=messages,
                                       add_generation_prompt=add_generation_prompt,
                                       **self.special_tokens)


# ------------------------------------------------------------------------------ a conversation

END_OF_TURN = "<|im_end|>"


class Conversation:
    """A chat with a model whose KV cache lives across turns (model_of_today).

    The cache holds exactly the ids fed so far (`ids`): the first turn's rendered template,
    then the reply's tokens as they are decoded, then each later turn's new text only. No turn
    prefills the conversation again: that is what the cache is for. A reply stops at the end
    of turn token (<|im_end|>) or after max_new_tokens.

    params, tokenizer: the model (kvlib.load_smollm2(), kvlib.smollm2_tokenizer()); system:
    an optional system message (without one SmolLM2's template writes its own). capacity:
    the positions the cache keeps (the model's context by default). parse_special: False
    (the default) encodes control tokens typed in a message as plain text, True as control
    tokens (Tokenizer.apply_chat_template says why the default is False).
    """

    def __init__(self, params, tokenizer, system: str | None = None,
                 capacity: int | None = None, *, parse_special: bool = False):
        from .cache import make_cache

        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("a conversation needs a chat model's tokenizer, with a template")
        system = as_instance("system", system, (str, type(None)), "the system message")
        self.parse_special = as_flag("parse_special", parse_special)
        self.params, self.tokenizer, self.system = params, tokenizer, system
        self.end_id = tokenizer.vocabulary[END_OF_TURN]
        self.cache = make_cache(params.config, capacity)
        self.reset()

    def reset(self) -> None:
        """Forget the conversation and empty the cache (its buffers are kept)."""
        self.cache.reset()
        self.messages = [] if self.system is None else [
            {"role": "system", "content": self.system}]
        self.ids: list[int] = []          # what the cache holds, in order
        self.spans: list[tuple[str, int, int]] = []   # ("turn" | "reply", start, end)
        self._unfed: list[int] = []       # the reply's last token: chosen, not yet fed

    def _new_ids(self, text: str) -> tuple[list[int], list[int]]:
        """(the end of the last reply, the new turn's ids) a user message adds: the whole
        rendered template the first time; later the reply's last token if it was no end of
        turn, then the end of turn and the new turn's text only. The message's text is
        marked as the template's rendering marks it, so both give the same ids."""
        tokenizer = self.tokenizer
        if not self.ids:
            return [], tokenizer.apply_chat_template(
                self.messages + [{"role": "user", "content": text}],
                parse_special=self.parse_special)
        reply_tail = [] if self._unfed == [self.end_id] else self._unfed
        if self.parse_special:
            encode = tokenizer.encode
        else:
            encode = tokenizer.encode_marked
            text = mark_control_tokens(text, control_token_pattern(tokenizer.special_tokens))
        return reply_tail, [self.end_id] + encode(
            f"\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")

    def say(self, text: str, max_new_tokens: int = 48, on_token=None) -> str:
        """Send a user message, decode the reply greedily with the cache -> the reply's text.
        on_token(text_so_far) is called after every new token (a widget streams with it).

        All or nothing: if anything fails or interrupts the turn (an on_token that raises,
        KeyboardInterrupt), the cache, ids and messages are put back as they were before the
        call, and the exception goes on."""
        if not as_instance("text", text, str).strip():
            raise ValueError("say something: the message must be non-empty text")
        max_new_tokens = as_whole_number("max_new_tokens", max_new_tokens, 1)
        reply_tail, turn = self._new_ids(text)
        capacity = self.cache.capacity
        needed = len(reply_tail) + len(turn) + max_new_tokens
        if capacity is not None and len(self.ids) + needed > capacity:
            raise ValueError(f"the cache holds {len(self.ids)} of {capacity} positions: this "
                             f"turn needs {needed} more. Start a new conversation (reset)")
        before = (self.cache.checkpoint(), list(self.ids), list(self.spans), list(self._unfed),
                  list(self.messages))
        try:
            words = self._turn(reply_tail, turn, max_new_tokens, on_token)
        except BaseException:           # KeyboardInterrupt too: the turn did not happen
            state, self.ids, self.spans, self._unfed, self.messages = before
            self.cache.restore(state)
            raise
        self.messages += [{"role": "user", "content": text},
                          {"role": "assistant", "content": words}]
        return words

    def _turn(self, reply_tail: list[int], turn: list[int], max_new_tokens: int,
              on_token) -> str:
        """say's work: prefill the new ids, decode the reply -> its text (ids and spans grow)."""
        from .inference import decode_step, prefill

        new = reply_tail + turn
        logits, _ = prefill(self.params, new, self.cache, last_only=True)
        start = len(self.ids)
        if reply_tail:
            self._extend_span("reply", len(reply_tail))
        self.spans.append(("turn", start + len(reply_tail), start + len(new)))
        self.ids += new
        reply = [int(logits[-1].argmax())]
        self.spans.append(("reply", len(self.ids), len(self.ids)))
        while reply[-1] != self.end_id and len(reply) < max_new_tokens:
            if on_token is not None:
                on_token(self.tokenizer.decode(reply))
            logits = decode_step(self.params, reply[-1], self.cache)
            self.ids.append(reply[-1])
            self._extend_span("reply", 1)
            reply.append(int(logits[-1].argmax()))
        self._unfed = reply[-1:]
        words = self.tokenizer.decode([t for t in reply if t != self.end_id])
        if on_token is not None:
            on_token(words)
        return words

    def _extend_span(self, kind: str, n: int) -> None:
        """The last span of this kind grows by n positions (the reply, token by token)."""
        index = max(i for i, span in enumerate(self.spans) if span[0] == kind)
        _, start, end = self.spans[index]
        self.spans[index] = (kind, start, end + n)

    def rendered_ids(self) -> list[int]:
        """The conversation so far as an app that keeps only the messages would send it: the
        template rendered again and tokenized again (model_of_today), control tokens typed in
        a message read as this conversation reads them (parse_special)."""
        return self.tokenizer.apply_chat_template(self.messages, add_generation_prompt=False,
                                                  parse_special=self.parse_special)


def reusable_prefix(cached_ids, new_ids) -> int:
    """How many positions of a cache that holds cached_ids a request for new_ids can keep
    (model_of_today and prefix_caching): the length of their common prefix. K and V of position p
    depend on the ids 0..p, so the first id that differs ends what can be reused."""
    length = 0
    cached_ids, new_ids = as_whole_numbers("cached_ids", cached_ids), as_whole_numbers("new_ids",
                                                                                      new_ids)
    for old, new in zip(cached_ids, new_ids):
        if old != new:
            break
        length += 1
    return length
