"""A third-party resolver plugin, as someone outside loraserve would write one.

`plugin-<name>` resolves to `<LORASERVE_TEST_PLUGIN_DIR>/<name>` when that folder exists. Every lookup is
recorded so tests can check the resolver chain's order and that resolvers are consulted only when allowed.
"""

from __future__ import annotations

import os

from loraserve import envs
from loraserve.lora.request import LoRARequest
from loraserve.lora.resolver import LoRAResolver, LoRAResolverRegistry

RESOLVER_NAME = "Test Plugin Resolver"
PREFIX = "plugin-"
lookups: list[str] = []
registrations: list[str] = []


class PrefixResolver(LoRAResolver):
    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        lookups.append(lora_name)
        root = envs.get_env("TEST_PLUGIN_DIR")
        if not root or not lora_name.startswith(PREFIX):
            return None
        path = os.path.join(root, lora_name[len(PREFIX) :])
        if not os.path.isdir(path):
            return None
        return LoRARequest(
            lora_name=lora_name, lora_int_id=1, lora_path=path, base_model_name=base_model_name
        )


def register_test_resolver() -> None:
    registrations.append("lora_test_resolver")
    LoRAResolverRegistry.register_resolver(RESOLVER_NAME, PrefixResolver())


def register_broken() -> None:
    registrations.append("lora_broken_plugin")
    raise RuntimeError("this plugin is broken on purpose")
