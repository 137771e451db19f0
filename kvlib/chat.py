"""Chat templates (notebook 18): how a conversation becomes the one text a model continues.

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

ROLES = ("system", "user", "assistant")


def check_messages(messages) -> list[dict[str, str]]:
    """messages as a list of {"role", "content"} dicts, or a clear error saying what is wrong."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError("messages must be a list of {'role': ..., 'content': ...} dicts, got "
                        f"{type(messages).__name__}")
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or set(message) != {"role", "content"}:
            raise ValueError(f"message {index} must be a dict with exactly the keys 'role' and "
                             f"'content', got {message!r}")
        role, content = message["role"], message["content"]
        if role not in ROLES:
            raise ValueError(f"message {index} has the role {role!r}; use one of {ROLES}")
        if not isinstance(content, str):
            raise TypeError(f"message {index}'s content must be text, got "
                            f"{type(content).__name__}")
        checked.append({"role": role, "content": content})
    return checked


class ChatTemplate:
    """A model's chat template (notebook 18): render(messages) -> the text the model reads.

    template: the Jinja source as the model ships it. Rendered like transformers'
    apply_chat_template: in jinja2's immutable sandbox, with trim_blocks and lstrip_blocks,
    `raise_exception` available to the template, and add_generation_prompt=True opening the
    assistant's turn so that the model's next tokens are its reply.
    """

    def __init__(self, template: str, **special_tokens: str):
        if not isinstance(template, str) or not template:
            raise ValueError("a chat template is the Jinja text the model ships with")
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
        if not isinstance(add_generation_prompt, bool):
            raise TypeError(f"add_generation_prompt must be True or False, got "
                            f"{add_generation_prompt!r}")
        return self._template().render(messages=check_messages(messages),
                                       add_generation_prompt=add_generation_prompt,
                                       **self.special_tokens)
