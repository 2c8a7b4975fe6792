"""Chat records rendered with a tokenizer's chat template, and which of their tokens are trained:
those of the assistant turns.

Few templates mark the assistant's text (`{% generation %}`), so each assistant turn i is
located by rendering: the conversation before it with the generation prompt (messages[:i],
add_generation_prompt=True) is a prefix of the conversation through it (messages[:i + 1]),
itself a prefix of the whole conversation; the characters between the two, less the whitespace
the template puts between turns, are the turn's: its text and end-of-turn marker, not the header
that the generation prompt supplies at inference (a template without a generation prompt leaves
the header in the turn). The whole conversation is tokenised once, as apply_chat_template
tokenises it, and a token is trained when its first character lies in an assistant turn: on a
template that marks the assistant's text with {% generation %}, what transformers'
return_assistant_tokens_mask gives.
"""
from __future__ import annotations

import numpy as np

ROLES = ("system", "user", "assistant")  # the roles every chat template renders


def check_messages(messages, where: str) -> None:
    """A non-empty list of {role, content} dicts with at least one assistant turn."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{role, content}} turns, got "
                         f"{type(messages).__name__} {str(messages)[:60]!r}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise ValueError(f"{where}: messages[{i}] = {str(m)[:60]!r} is not a {{role, content}} turn (a dict with "
                             "a string 'role' and a 'content')")
    if not any(m["role"] == "assistant" for m in messages):
        roles = ", ".join(m["role"] for m in messages)
        raise ValueError(f"{where}: the messages have no 'assistant' turn (roles: {roles}), so nothing of them is "
                         "trained; drop the record, or give it as text")


def render_chat(tok, messages: list[dict], where: str) -> tuple[list[int], np.ndarray]:
    """(ids, mask) of one conversation: the ids apply_chat_template gives, and (len(ids),) bool
    True on the assistant turns' tokens. `tok`: a fast tokenizer with a chat template."""
    check_messages(messages, where)

    def render(turns: list[dict], generation_prompt: bool) -> str:
        try:
            return tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as e:  # the template's own error (jinja2 raises several kinds)
            raise ValueError(f"{where}: the chat template fails on messages[:{len(turns)}]: {e}") from None

    text = render(messages, False)
    for i, m in enumerate(messages):  # a role the template does not know may vanish from its text, untrained
        content = m["content"].strip() if isinstance(m["content"], str) else ""
        if m["role"] not in ROLES and content and content not in text:
            raise ValueError(f"{where}: messages[{i}] has role {m['role']!r}, which the chat template leaves out (its "
                             f"content is not in the rendered text); use one of {', '.join(ROLES)} or a role the "
                             "template renders (e.g. tool)")
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        through = render(messages[: i + 1], False)
        before = (render(messages[:i], True), render(messages[:i], False)) if i else ("",)
        prefix = next((p for p in before if through.startswith(p)), None)
        if prefix is None or not text.startswith(through):
            raise ValueError(f"{where}: the chat template does not render the conversation up to messages[{i}] as "
                             "the start of the whole one (it changes earlier turns as later ones come), so the "
                             "assistant's tokens cannot be located; use a template that renders turns in order")
        spans.append((len(prefix), len(through.rstrip())))
    encoded = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    first = np.array([s for s, _ in encoded["offset_mapping"]], dtype=np.int64)  # each token's first character
    mask = np.zeros(len(first), dtype=bool)
    for start, end in spans:
        mask |= (first >= start) & (first < end)
    return list(encoded["input_ids"]), mask
