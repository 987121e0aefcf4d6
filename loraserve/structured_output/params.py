"""What a request asks its output to match: vLLM's `StructuredOutputsParams`, and the grammar key.

A request names exactly one constraint (vLLM's rule and text); `grammar_key()` turns it into the
`GrammarKey` (kind, canonical text) by which compiled grammars are cached and looked up.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from loraserve.json_limits import loads_bounded

GrammarKind = Literal["json", "json_object", "regex", "choice", "grammar", "structural_tag"]


@dataclass(frozen=True, slots=True)
class GrammarKey:
    """One grammar to compile: its kind, its canonical text (JSON for schemas and choices) and, for
    JSON, whether any whitespace may separate tokens. Schemas compile strictly (as vLLM compiles them
    with xgrammar: no properties beyond those declared unless the schema allows them), so a
    response_format's `strict` changes nothing."""

    kind: GrammarKind
    text: str
    any_whitespace: bool = True


@dataclass(slots=True)
class StructuredOutputsParams:
    """vLLM's field names: set exactly one of json, regex, choice, grammar, json_object, structural_tag."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    # The request field that carried the constraint ("response_format", "guided_regex", "tools", ...),
    # which a refusal names; set by the serving layer, never by a client.
    param: str | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        count = sum(getattr(self, name) is not None for name in _CONSTRAINTS)
        if count > 1:  # vLLM's texts
            raise ValueError(
                "You can only use one kind of structured outputs constraint but multiple are specified: "
                f"{self._constraints()}"
            )
        if count < 1:
            raise ValueError(
                "You must use one kind of structured outputs constraint but none are specified: "
                f"{self._constraints()}"
            )
        if self.whitespace_pattern is not None:
            raise ValueError(
                "structured_outputs.whitespace_pattern is not supported by the xgrammar backend; use "
                "disable_any_whitespace."
            )
        if self.choice is not None and (
            not isinstance(self.choice, list)
            or not self.choice
            or not all(isinstance(c, str) for c in self.choice)
        ):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings.")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError("structured_outputs.json_object must be true when given.")

    def _constraints(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _CONSTRAINTS}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> StructuredOutputsParams:
        """From a request's `structured_outputs` object; an unknown key is a ValueError naming it."""
        known = {f.name for f in fields(cls)} - {"param"}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"structured_outputs has unknown field(s): {', '.join(unknown)}.")
        return cls(**values)

    def grammar_key(self) -> GrammarKey:
        """The cache key of this constraint; a schema given as text must parse as JSON."""
        any_ws = not self.disable_any_whitespace
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = loads_bounded(schema, "The JSON schema", self.param)
                except json.JSONDecodeError as exc:
                    raise ValueError("Invalid JSON grammar specification.") from exc  # vLLM's text
            if not isinstance(schema, (dict, bool)):
                raise ValueError("The JSON schema must be a JSON object.")
            # Not sorted: the order of the properties is the order the output writes them in.
            return GrammarKey("json", json.dumps(schema), any_ws)
        if self.json_object:
            return GrammarKey("json_object", "", any_ws)
        if self.regex is not None:
            return GrammarKey("regex", self.regex)
        if self.choice is not None:
            return GrammarKey("choice", json.dumps(self.choice))
        if self.grammar is not None:
            return GrammarKey("grammar", self.grammar)
        assert self.structural_tag is not None
        return GrammarKey("structural_tag", self.structural_tag)


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
