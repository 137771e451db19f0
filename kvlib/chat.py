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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .checks import as_instance, as_whole_number, as_whole_numbers

ROLES = ("system", "user", "assistant")


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

    def render(self, messages, add_generation_prompt: bool = True) -> str:
        """The text of a conversation: messages [{"role": "user", "content": "..."}, ...]
        -> one string; with add_generation_prompt the assistant's turn is opened."""
        return self._template().render(messages=check_messages(messages),
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
    the positions the cache keeps (the model's context by default).
    """

    def __init__(self, params, tokenizer, system: str | None = None,
                 capacity: int | None = None):
        from .cache import make_cache

        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("a conversation needs a chat model's tokenizer, with a template")
        system = as_instance("system", system, (str, type(None)), "the system message")
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
        turn, then the end of turn and the new turn's text only."""
        if not self.ids:
            rendered = self.tokenizer.chat_template.render(
                self.messages + [{"role": "user", "content": text}])
            return [], self.tokenizer.encode(rendered)
        reply_tail = [] if self._unfed == [self.end_id] else self._unfed
        return reply_tail, [self.end_id] + self.tokenizer.encode(
            f"\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")

    def say(self, text: str, max_new_tokens: int = 48, on_token=None) -> str:
        """Send a user message, decode the reply greedily with the cache -> the reply's text.
        on_token(text_so_far) is called after every new token (a widget streams with it)."""
        from .inference import decode_step, prefill

        if not as_instance("text", text, str).strip():
            raise ValueError("say something: the message must be non-empty text")
        max_new_tokens = as_whole_number("max_new_tokens", max_new_tokens, 1)
        reply_tail, turn = self._new_ids(text)
        new = reply_tail + turn
        capacity = self.cache.capacity
        if capacity is not None and len(self.ids) + len(new) + max_new_tokens > capacity:
            raise ValueError(f"the cache holds {len(self.ids)} of {capacity} positions: this "
                             f"turn needs {len(new) + max_new_tokens} more. Start a new "
                             "conversation (reset)")
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
        self.messages += [{"role": "user", "content": text},
                          {"role": "assistant", "content": words}]
        return words

    def _extend_span(self, kind: str, n: int) -> None:
        """The last span of this kind grows by n positions (the reply, token by token)."""
        index = max(i for i, span in enumerate(self.spans) if span[0] == kind)
        _, start, end = self.spans[index]
        self.spans[index] = (kind, start, end + n)

    def rendered_ids(self) -> list[int]:
        """The conversation so far as an app that keeps only the messages would send it: the
        template rendered again and tokenized again (model_of_today)."""
        return self.tokenizer.apply_chat_template(self.messages, add_generation_prompt=False)


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
