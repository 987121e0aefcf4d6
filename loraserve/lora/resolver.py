"""LoRA resolver plugins: the `LoRAResolver` interface and the process-wide registry of resolvers.

A resolver turns an adapter name the server has never seen into a `LoRARequest` (or None). The serving
layer asks every registered resolver in registration order, only when runtime LoRA updating is on.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from loraserve.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class LoRAResolver(ABC):
    """Locates an adapter by name; returning None lets the next resolver try."""

    @abstractmethod
    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        """Find `lora_name` for the served base model `base_model_name`; None when not found here."""


@dataclass(slots=True)
class _LoRAResolverRegistry:
    resolvers: dict[str, LoRAResolver] = field(default_factory=dict)

    def get_supported_resolvers(self) -> list[str]:
        """Names of the registered resolvers, in registration order."""
        return list(self.resolvers)

    def register_resolver(self, resolver_name: str, resolver: LoRAResolver) -> None:
        """Register `resolver`; a second registration under the same name replaces the first."""
        if not isinstance(resolver, LoRAResolver):
            raise TypeError(
                f"resolver {resolver_name!r} must be a LoRAResolver instance, got {type(resolver).__name__}."
            )
        if resolver_name in self.resolvers:
            logger.warning(
                "LoRA resolver %r is already registered; the new instance (%s) replaces it.",
                resolver_name,
                type(resolver).__name__,
            )
        self.resolvers[resolver_name] = resolver

    def get_resolver(self, resolver_name: str) -> LoRAResolver:
        """The resolver registered as `resolver_name`; KeyError naming the known ones otherwise."""
        if resolver_name not in self.resolvers:
            raise KeyError(
                f"LoRA resolver {resolver_name!r} not found; registered resolvers: "
                f"{self.get_supported_resolvers()}."
            )
        return self.resolvers[resolver_name]

    def unregister_resolver(self, resolver_name: str) -> None:
        """Remove a resolver (tests, and plugins that replace themselves); unknown names are ignored."""
        self.resolvers.pop(resolver_name, None)


LoRAResolverRegistry = _LoRAResolverRegistry()
