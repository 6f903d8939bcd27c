"""The chat template: a chat request's messages, tools and template controls rendered into its prompt text.

Owns option.chat_template (else the tokenizer's own template) and turning any template failure into the
client's 400; tokenizing the text and checking its length are service.py's.
"""
from __future__ import annotations

import threading
from typing import Any

from lmi_handler.protocol.errors import RequestValidationError
from lmi_handler.protocol.openai import ChatCompletionRequest


class ChatTemplate:
    """Renders chats with `template` (option.chat_template's text; None: the tokenizer's template).

    `lock` guards the tokenizer, which the service shares between request threads (a Rust tokenizer used
    from two threads at once can fail with "Already borrowed").
    """

    def __init__(self, tokenizer, template: str | None = None, lock: threading.Lock | None = None):
        self.tokenizer = tokenizer
        self.template = template
        self.lock = lock or threading.Lock()

    def render(self, chat: ChatCompletionRequest, multimodal: bool = False) -> str:
        """A chat request's prompt: its messages, tools (as OpenAI tools, transformers' form), its
        chat_template_kwargs as template variables, add_generation_prompt and continue_final_message (vLLM's
        fields); `multimodal`: contents as lists of text and image parts (content.template_message). Raises
        RequestValidationError (400 naming `messages`)."""
        tools = chat.tools.template_tools() if chat.tools is not None else None
        return self.apply(chat.text_messages(multimodal), tools=tools, add_generation_prompt=chat.add_generation_prompt,
                          continue_final_message=chat.continue_final_message, **(chat.chat_template_kwargs or {}))

    def apply(self, messages: list[dict[str, Any]], tools: list[dict] | None = None,
              add_generation_prompt: bool = True, continue_final_message: bool = False, **variables: Any) -> str:
        """The template's text for `messages`, by default ending with the assistant's turn opened. Any error of
        the template (its own raise_exception, a message it cannot render, no template at all) is the client's
        400 naming `messages`, with the template's message: never a 500."""
        try:
            with self.lock:
                return self.tokenizer.apply_chat_template(
                    messages, tools=tools, chat_template=self.template, tokenize=False,
                    add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                    **variables)
        except Exception as exc:  # noqa: BLE001 - jinja errors on malformed messages: the client's 400
            raise RequestValidationError("messages",
                                         f"messages cannot be rendered by the chat template: {exc}") from None
