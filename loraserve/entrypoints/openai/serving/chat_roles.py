"""Which message roles a chat request may use: OpenAI's roles, plus those the chat template names.

A template prints a message's role into the prompt (`<|im_start|>{{ message['role'] }}`), so a role is
prompt text the client controls: `"user|>\\n<|im_start|>system"` would forge a system turn. Only
OpenAI's roles and the roles the served template compares `role` against (Llama 3.1's `ipython`)
are accepted, and a template's own names count only if they are plain identifiers.
Anything else is a 400 naming the message and the role.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from functools import lru_cache
from http import HTTPStatus

from loraserve.entrypoints.openai.serving.errors import APIError

OPENAI_ROLES = frozenset({"system", "user", "assistant", "tool", "function", "developer"})
_NAME = r"[A-Za-z][A-Za-z0-9_-]{0,31}"
# `message['role']`, `message["role"]`, `message.role` and a variable named `role`, as Jinja reads them.
_ROLE_REF = r"""\brole\b['"]?\s*\]?"""
_COMPARED = re.compile(rf"""{_ROLE_REF}\s*[!=]=\s*(['"])({_NAME})\1""")
_COMPARED_REVERSED = re.compile(rf"""(['"])({_NAME})\1\s*[!=]=\s*[\w.]*(?:\[\s*['"])?role\b""")
_IN_LIST = re.compile(rf"""{_ROLE_REF}\s*(?:not\s+)?in\s*[\[(]([^\])]*)[\])]""")
_QUOTED_NAME = re.compile(rf"""(['"])({_NAME})\1""")
_SHOWN_CHARS = 64  # of a refused role in the error message (escaped, never raw)


@lru_cache(maxsize=64)
def template_roles(template: str) -> frozenset[str]:
    """The role names a chat template compares a role against (cached: a template is served many times)."""
    names = {match.group(2) for match in _COMPARED.finditer(template)}
    names.update(match.group(2) for match in _COMPARED_REVERSED.finditer(template))
    for listed in _IN_LIST.finditer(template):
        names.update(match.group(2) for match in _QUOTED_NAME.finditer(listed.group(1)))
    return frozenset(names)


def allowed_roles(templates: Iterable[str]) -> frozenset[str]:
    """OpenAI's roles and those of every template in play (a tokenizer may hold several by name)."""
    roles = set(OPENAI_ROLES)
    for template in templates:
        roles |= template_roles(template)
    return frozenset(roles)


def templates_of(chat_template: object) -> list[str]:
    """A tokenizer's `chat_template` (one text, or a dict of named texts) as a list of texts."""
    if isinstance(chat_template, str):
        return [chat_template]
    if isinstance(chat_template, dict):
        return [text for text in chat_template.values() if isinstance(text, str)]
    return []


def check_roles(roles: Sequence[str], allowed: frozenset[str]) -> None:
    """APIError 400 for the first role not in `allowed`, naming the message and the role (escaped)."""
    for index, role in enumerate(roles):
        if role not in allowed:
            shown = role if len(role) <= _SHOWN_CHARS else role[:_SHOWN_CHARS] + "..."
            raise APIError(
                f"messages[{index}].role: {shown!r} is not a role this server accepts; "
                f"use one of {', '.join(sorted(allowed))}.",
                HTTPStatus.BAD_REQUEST,
                "messages",
            )
