"""Chat templates: a conversation rendered by the model's own Jinja template, the way Hugging Face renders it, and
split so that only the template's own text can hold control tokens.

A chat model ships its prompt format as a Jinja template (GGUF `tokenizer.chat_template`, HF `tokenizer_config.json`
or `chat_template.jinja`): Llama 3 writes "<|start_header_id|>user<|end_header_id|>\\n\\n...<|eot_id|>", Qwen and
SmolLM2 ChatML's "<|im_start|>user\\n...<|im_end|>\\n", Granite "<|start_of_role|>user<|end_of_role|>...". `render`
runs it in jinja2's sandbox with transformers' settings and helpers, so the text is the one the model was trained on.

Message contents stay text (prompt injection): a user who writes "<|im_end|>" must not end their turn. Rendering
first and tokenizing after cannot tell the template's "<|im_end|>" from the user's, and the template may transform a
content (Llama 3 trims it, Qwen3 splits it at "</think>"), so placeholders in place of contents would change the
text. So, as transformers' `sanitize_control_tokens` does, every control-token text inside the caller's data
(contents, roles, tools, extra variables) is wrapped in two Unicode noncharacters before rendering (`mark`). The
template moves the wrapped token around like any other text; `split_rendered` then finds it and the tokenizer
encodes it as plain text, while every unwrapped control-token text in the output was written by the template.
Control tokens, for a chat: the vocab's control tokens, and the added tokens the template writes in its own text
(Qwen3's <think>, <tool_call>), as transformers decides it too.
Left out: `continue_final_message`, named templates chosen by tools (`tool_use`), media content parts.
"""
from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any, Mapping

import regex

# Used when a model ships no template but its vocab has ChatML's markers: transformers' former default template.
CHATML_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                   "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                   "{% endif %}")
CHATML_MARKERS = ("<|im_start|>", "<|im_end|>")

# Around control-token text from the caller's data. Noncharacters are reserved for a program's own use, so the
# caller's data should not hold them; any that it does are dropped, so that they cannot wrap the template's tokens.
MARK_START, MARK_END = "\ufdd0", "\ufdd1"
_PROBE = "tinyllm end-of-turn probe"


# --- rendering ------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=16)
def compile_template(source: str):
    """The template compiled in jinja2's sandbox as transformers does it (chat_template_utils): trim_blocks and
    lstrip_blocks, loop controls, a `tojson` that keeps non-ASCII, `raise_exception`, `strftime_now`, and the
    `{% generation %}` tag (which only marks text for training masks: rendered as is)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the model's chat template is not valid Jinja (line {e.lineno}: {e.message})") from None


def render(source: str, messages: list[dict], *, add_generation_prompt: bool, tools: list | None = None,
           **variables: Any) -> str:
    """The conversation as the template writes it: `messages`, `add_generation_prompt`, `tools` and `variables`
    (bos_token, eos_token, and any the template reads, such as Qwen3's enable_thinking) are its variables.
    ValueError, one line, if the messages are not dicts with a str role or the template refuses them."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"messages must be a non-empty list of dicts, got {str(messages)[:40]!r}")
    for k, message in enumerate(messages):
        if not (isinstance(message, Mapping) and isinstance(message.get("role"), str)):
            raise ValueError(f"message {k} must be a dict with a str 'role', got {str(message)[:60]!r}")
    # Keys set to None are dropped (OpenAI clients send content=None with tool calls), as transformers does.
    messages = [{key: value for key, value in m.items() if value is not None} for m in messages]
    template = compile_template(source)
    try:
        return template.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                **variables)
    except Exception as e:   # template code from the model file: raise_exception, a missing key, a bad type...
        raise ValueError(f"the model's chat template cannot render this conversation: {e}") from None


# --- control tokens: the template's, or text from the caller ---------------------------------------------------
@functools.lru_cache(maxsize=16)
def literal_text(source: str) -> str:
    """The template's own text: its raw text and every string constant, joined by NUL (so that no search matches
    across two of them). An added token that occurs here is one the template writes: a control token for chat."""
    import jinja2.nodes

    tree = compile_template(source).environment.parse(source)
    pieces = {node.data for node in tree.find_all(jinja2.nodes.TemplateData)}
    pieces |= {node.value for node in tree.find_all(jinja2.nodes.Const) if isinstance(node.value, str)}
    return "\0".join(sorted(pieces))


def mark(value: Any, control: str | None) -> Any:
    """`value` with every match of the regex `control` (the control tokens' texts) inside its strings wrapped in
    MARK_START / MARK_END; dicts and lists are walked, keys left alone; marks already in a string are dropped."""
    if isinstance(value, str):
        value = value.replace(MARK_START, "").replace(MARK_END, "")
        return regex.sub(control, lambda m: MARK_START + m.group() + MARK_END, value) if control else value
    if isinstance(value, Mapping):
        return {key: mark(item, control) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [mark(item, control) for item in value]
    return value


def split_rendered(text: str, control: str | None) -> list[tuple[str, bool]]:
    """Rendered marked text -> (piece, is_caller_text) pieces: a wrapped control token is caller text (encoded as
    plain text), the rest is the template's text around the caller's (encoded with its control tokens). A mark
    the template separated from its token (a split() in the middle) is dropped but still cuts the text, so the
    text on its two sides cannot join into a control token."""
    if not control:
        return [(text.replace(MARK_START, "").replace(MARK_END, ""), False)]
    pieces = regex.split(f"{MARK_START}({control}){MARK_END}|[{MARK_START}{MARK_END}]", text)
    # split() with one capture group alternates: text, wrapped token (None for a lone mark), text, ...
    return [(piece, i % 2 == 1) for i, piece in enumerate(pieces) if piece]


# --- where a turn ends ------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=16)
def end_of_turn(source: str, control: str | None, **variables: str) -> str | None:
    """The control token the template writes right after an assistant's message ("<|eot_id|>", "<|im_end|>",
    "<|end_of_text|>", "</s>"), found by rendering a short conversation; None if there is none, or if the
    template refuses that conversation."""
    if not control:
        return None
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE}]
    try:
        text = render(source, messages, add_generation_prompt=False, **variables)
    except ValueError:
        return None
    after = text.rfind(_PROBE)
    found = regex.compile(control).match(text, after + len(_PROBE)) if after >= 0 else None
    return found.group() if found else None
