"""ChatML, the chat format of SmolLM2-style models, written in Python: a conversation as (text, is_marker) parts.

Every message becomes "<|im_start|>{role}\\n{content}<|im_end|>\\n"; a conversation that does not open with a
system message gets the template's default one. The markers are kept apart from the text so that the tokenizer
can make them control tokens and encode every role and content as plain text (tokenizer.Tokenizer.encode_chat).
Left out: rendering a template's Jinja (only the plain ChatML of such templates is recognised; no tools).
"""
from __future__ import annotations

from typing import Mapping

import regex

CHATML_MARKERS = ("<|im_start|>", "<|im_end|>")   # a turn's start and end: control tokens in ChatML vocabs


def chatml_parts(messages: list[dict], add_generation_prompt: bool, template: str | None) -> list[tuple[str, bool]]:
    """ChatML as (text, is_marker) parts: markers are the template's own <|im_start|> / <|im_end|>.
    add_generation_prompt ends with "<|im_start|>assistant\\n", so the model writes the answer next."""
    default_system = _chatml_default_system(template)
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    start, end = CHATML_MARKERS
    turns = []
    for k, message in enumerate(messages):
        if not (isinstance(message, Mapping) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise ValueError(f"message {k} must be a dict with str 'role' and 'content', got {message!r}")
        if k == 0 and message["role"] != "system" and default_system is not None:
            turns.append(("system", default_system))
        turns.append((message["role"], message["content"]))
    parts = []
    for role, content in turns:
        parts += [(start, True), (f"{role}\n{content}", False), (end, True), ("\n", False)]
    if add_generation_prompt:
        parts += [(start, True), ("assistant\n", False)]
    return parts


def _chatml_default_system(template: str | None) -> str | None:
    """The default system message of a ChatML template, or None; ValueError if the template is not ChatML."""
    if template is None:
        raise ValueError("this model has no chat template; build the prompt text yourself")
    if "<|im_start|>" not in template:
        raise ValueError("this model's chat template is not ChatML, the only format tinyllm renders")
    # The default message is a string constant in the template: '<|im_start|>system\n...<|im_end|>' (with \n a
    # newline or written as backslash-n). Quotes or braces inside mean template code, not a constant: skip those.
    found = regex.search(r"<\|im_start\|>system(?:\n|\\n)([^'\"{}]*?)<\|im_end\|>", template)
    return found.group(1) if found else None
