"""Chat records rendered with a chat template, and which of their tokens are trained: those of
the assistant turns, as each turn is rendered in the whole conversation.

The conversation is rendered once, whole, as apply_chat_template renders it, and tokenised once;
a token is trained when its first character lies in an assistant turn's characters. The turns'
characters are found in one of three ways, chosen once per template (ChatFormat):

- marks: a template that marks the assistant's output with {% generation %} gives each marked
  span, as written (what transformers' return_assistant_tokens_mask reads).
- family marks: a template that rewrites earlier turns once later ones come (Qwen3 drops the
  reasoning of turns before the last query; GPT-OSS drops the analysis channel of all but the
  last turn and ends earlier turns with <|end|>, the last with <|return|>) is rendered with
  {% generation %} put around its assistant branch (the text is unchanged, only marked), so each
  turn is trained as it stands in the final conversation; the header the generation prompt
  supplies at inference ('<|im_start|>assistant\\n', '<|start|>assistant') and the whitespace
  after the turn are cut from the span.
- prefixes: otherwise, turn i is located by rendering: the conversation before it with the
  generation prompt (messages[:i], add_generation_prompt=True) is a prefix of the conversation
  through it (messages[:i + 1]), itself a prefix of the whole; the characters between the two,
  less the whitespace the template puts between turns, are the turn's (a template without a
  generation prompt leaves the header in the turn). A template that rewrites earlier turns and
  is of no known family is refused: give one with {% generation %} marks (--chat-template).

A prompt/completion record trains the completion only: the prompt rendered with the generation
prompt is a prefix of the whole, and only assistant characters after it are trained.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROLES = ("system", "user", "assistant")  # the roles every chat template renders
GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")  # transformers' own test for marks
ASSISTANT_BRANCH = re.compile(r"\{%-?\s*(?:el)?if\s+message\.role\s*==\s*[\"']assistant[\"']\s*-?%\}")
TOOL_BRANCH = re.compile(r"\{%-?\s*elif\s+message\.role\s*==\s*[\"']tool[\"']\s*-?%\}")
# Templates that rewrite earlier turns, known by their control tokens; each renders an assistant
# message in one `if message.role == 'assistant'` branch followed by the tool message's branch.
FAMILIES = {"qwen3": ("<|im_start|>", "reasoning_content"), "gpt-oss": ("<|start|>assistant", "<|channel|>")}


def read_template(path: str) -> str:
    """--chat-template FILE: a Jinja chat template (rendered in transformers' sandbox: data, not code)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"--chat-template {path!r}: cannot read it ({e.strerror}); give a Jinja template file") from None
    return text


def family_of(template: str) -> str:
    return next((name for name, tokens in FAMILIES.items() if all(t in template for t in tokens)), "")


def mark_assistant_branch(template: str, family: str) -> str:
    """The template with {% generation %} around its assistant branch: the same text, marked."""
    starts, ends = list(ASSISTANT_BRANCH.finditer(template)), list(TOOL_BRANCH.finditer(template))
    if len(starts) != 1 or len(ends) != 1 or starts[0].end() > ends[0].start():
        raise ValueError(f"the chat template looks like a {family} template, but its assistant messages are not "
                         "rendered in one `message.role == 'assistant'` branch before the tool branch, so oomb cannot "
                         "mark them; give a template with {% generation %} marks around the assistant's output "
                         "(--chat-template FILE)")
    a, b = starts[0].end(), ends[0].start()
    return template[:a] + "{%- generation %}" + template[a:b] + "{%- endgeneration %}" + template[b:]


@dataclass(frozen=True)
class ChatFormat:
    """How one template's chats are rendered and where their assistant turns lie."""
    template: str  # the Jinja text that renders the conversation
    variables: dict = field(default_factory=dict)  # the special tokens the template may name
    marked: str | None = None  # the template with {% generation %} marks: the turns' spans; None: by prefixes
    header: str = ""  # cut from the start of a marked span (family marks: the generation prompt's header)
    family: str = ""

    @classmethod
    def of(cls, template: str, variables: dict) -> "ChatFormat":
        if GENERATION.search(template):
            return cls(template, variables, marked=template)
        family = family_of(template)
        if not family:
            return cls(template, variables)
        fmt = cls(template, variables, mark_assistant_branch(template, family), family=family)
        probe = [{"role": "user", "content": "x"}]
        header = fmt.render(probe, None, True, "the generation prompt")[0][len(fmt.render(probe, None, False, "")[0]):]
        return cls(template, variables, fmt.marked, header, family)

    def render(self, messages: list[dict], tools: list | None, generation_prompt: bool, where: str,
               marks: bool = False) -> tuple[str, list[tuple[int, int]]]:
        """(text, marked spans) as apply_chat_template renders it; spans only with marks=True."""
        from transformers.utils.chat_template_utils import render_jinja_template

        try:
            texts, spans = render_jinja_template(
                conversations=[messages], tools=tools, chat_template=self.marked if marks else self.template,
                add_generation_prompt=generation_prompt, return_assistant_tokens_mask=marks, **self.variables)
        except Exception as e:  # the template's own error (jinja2 raises several kinds)
            raise ValueError(f"{where}: the chat template fails on messages[:{len(messages)}]: {e}") from None
        return texts[0], (spans[0] if marks else [])

    def assistant_spans(self, messages: list[dict], tools: list | None, where: str) -> tuple[str, list]:
        """(the whole conversation's text, [start, end) of each assistant turn's trained characters)."""
        if self.marked is not None:
            text, spans = self.render(messages, tools, False, where, marks=True)
            if self.header:
                spans = [(s + len(self.header) if text.startswith(self.header, s) else s, e) for s, e in spans]
                spans = [(s, s + len(text[s:e].rstrip())) for s, e in spans if e > s]
            return text, spans
        text = self.render(messages, tools, False, where)[0]
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            through = self.render(messages[: i + 1], tools, False, where)[0]
            before = (self.render(messages[:i], tools, True, where)[0],
                      self.render(messages[:i], tools, False, where)[0]) if i else ("",)
            prefix = next((p for p in before if through.startswith(p)), None)
            if prefix is None or not text.startswith(through):
                raise ValueError(f"{where}: the chat template does not render the conversation up to messages[{i}] as "
                                 "the start of the whole one (it changes earlier turns as later ones come), so the "
                                 "assistant's tokens cannot be located; give a template with {% generation %} marks "
                                 "around the assistant's output (--chat-template FILE)")
            spans.append((len(prefix), len(through.rstrip())))
        return text, spans


def check_messages(messages, where: str, name: str = "messages", assistant: bool = True) -> list[dict]:
    """A non-empty list of {role, content} dicts (with at least one assistant turn), their null
    fields dropped (a columnar source holds nulls where a turn lacks a field)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: '{name}' must be a non-empty list of {{role, content}} turns, got "
                         f"{type(messages).__name__} {str(messages)[:60]!r}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not ("content" in m or "tool_calls" in m):
            raise ValueError(f"{where}: {name}[{i}] = {str(m)[:60]!r} is not a {{role, content}} turn (a dict with "
                             "a string 'role' and a 'content', or an assistant's 'tool_calls')")
    if assistant and not any(m["role"] == "assistant" for m in messages):
        roles = ", ".join(m["role"] for m in messages)
        raise ValueError(f"{where}: the {name} have no 'assistant' turn (roles: {roles}), so nothing of them is "
                         "trained; drop the record, or give it as text")
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


def check_tools(tools, where: str) -> list[dict] | None:
    """A record's tools: a list of JSON schemas (dicts), or that list as a JSON string (as datasets
    often store it); None or empty: no tools."""
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: 'tools' is a string but not JSON ({e}); give a list of JSON schemas") from None
    if not tools:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ValueError(f"{where}: 'tools' must be a list of JSON schemas (dicts, e.g. {{'type': 'function', "
                         f"'function': {{...}}}}), got {str(tools)[:60]!r}")
    return tools


class ChatRenderer:
    """(ids, mask) of chat records for one codec (data/needles.py: a tokenizer or bytes) and
    template (the codec's own, or --chat-template's text)."""

    def __init__(self, codec, template: str | None = None, model: str = "") -> None:
        template = template or codec.chat_template
        if not template:
            raise ValueError(f"the tokenizer of --model {model!r} has no chat template, which chat ('messages') and "
                             "conversational prompt/completion records need; give one with --chat-template FILE, or "
                             "use an instruct checkpoint's tokenizer")
        if isinstance(template, str) and "messages" not in template:
            raise ValueError(f"the chat template {template[:80]!r} never reads `messages`: it is not one (a Jinja text "
                             "that loops over messages, e.g. a checkpoint's chat_template.jinja)")
        tokenizer = getattr(codec, "tokenizer", None)
        if tokenizer is not None and not tokenizer.is_fast:
            raise ValueError(f"the tokenizer of --model {model!r} is a slow (Python) one; locating the assistant's "
                             "tokens needs a fast one (tokenizer.json) for their character offsets")
        self.codec, self.template, self.formats = codec, template, {}

    def format(self, tools: list | None) -> ChatFormat:
        """The template for a record with or without tools (a tokenizer may name one for tool use)."""
        key = tools is not None
        if key not in self.formats:
            template = self.template
            if isinstance(template, dict):  # named templates: transformers' choice
                template = self.codec.tokenizer.get_chat_template(None, tools)
            self.formats[key] = ChatFormat.of(template, self.codec.template_variables)
        return self.formats[key]

    def __call__(self, messages: list[dict], where: str, tools: list | None = None,
                 prompt: list[dict] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(ids, mask (len(ids),) bool) of `messages`; with `prompt` (its first turns), only the
        turns after the prompt are trained."""
        fmt = self.format(tools)
        text, spans = fmt.assistant_spans(messages, tools, where)
        for i, m in enumerate(messages):  # a role the template does not know may vanish from its text, untrained
            content = m.get("content").strip() if isinstance(m.get("content"), str) else ""
            if m["role"] not in ROLES and content and content not in text:
                raise ValueError(f"{where}: messages[{i}] has role {m['role']!r}, which the chat template leaves out "
                                 f"(its content is not in the rendered text); use one of {', '.join(ROLES)} or a role "
                                 "the template renders (e.g. tool)")
        if prompt is not None:
            start = fmt.render(prompt, tools, True, where)[0]
            if not text.startswith(start):
                raise ValueError(f"{where}: the chat template renders the prompt differently once the completion "
                                 "follows, so the completion cannot be located; give a template that renders turns "
                                 "in order (--chat-template FILE)")
            spans = [(max(s, len(start)), e) for s, e in spans if e > len(start)]
        ids, first = self.codec.with_offsets(text)
        mask = np.zeros(len(first), dtype=bool)
        for start, end in spans:
            mask |= (first >= start) & (first < end)
        return ids, mask


def render_chat(tok, messages: list[dict], where: str, tools: list | None = None,
                template: str | None = None) -> tuple[list[int], np.ndarray]:
    """(ids, mask) of one conversation with a transformers tokenizer: the ids apply_chat_template
    gives, and (len(ids),) bool True on the assistant turns' tokens."""
    from ..data.codec import TokenizerCodec

    ids, mask = ChatRenderer(TokenizerCodec(tok), template)(check_messages(messages, where), where,
                                                            check_tools(tools, where))
    return ids.tolist(), mask
