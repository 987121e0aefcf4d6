"""Adapter files on the replica's own machine: what `EngineReplica` hands its engine.

The ingress resolves an adapter name (its resolvers download into the ingress machine's cache) and
sends the replica a `LoRARequest` whose path is a folder on the ingress machine. A replica on another
node has no such folder: it asks its own resolvers for the same name, so a shared store (S3) is read
once per replica into that replica's cache, and nothing but the store is shared. Paths that are not
absolute (a Hugging Face repo id, `~`) are left to the engine, which resolves them itself. As at the
ingress, resolvers are asked only when runtime loading is on. The name is what is resolved: an
adapter loaded through the API from a folder only the ingress machine has is served from the
store's adapter of that name, if the store has one.
"""

from __future__ import annotations

import dataclasses
import logging
import os

from loraserve import envs
from loraserve.lora.request import LoRARequest
from loraserve.lora.resolver import LoRAResolverRegistry

logger = logging.getLogger(__name__)


async def local_adapter(lora_request: LoRARequest, base_model_name: str) -> LoRARequest:
    """`lora_request` with a path that exists here: itself when its folder is here (one machine, or
    a shared folder), else the folder this replica's resolvers fetch for its name. When no resolver
    finds it the request goes on unchanged and the engine reports the missing files by name."""
    if not envs.allow_runtime_lora_updating() or not os.path.isabs(lora_request.lora_path) \
            or os.path.isdir(lora_request.lora_path):
        return lora_request  # resolvers are consulted only where runtime loading is on, as at the ingress
    for resolver_name in LoRAResolverRegistry.get_supported_resolvers():
        resolver = LoRAResolverRegistry.get_resolver(resolver_name)
        try:
            found = await resolver.resolve_lora(base_model_name, lora_request.lora_name)
        except Exception as e:  # noqa: BLE001 - one resolver's failure leaves the others their turn
            logger.warning("Resolver %s could not fetch LoRA adapter '%s' on this replica: %s",
                           resolver_name, lora_request.lora_name, e)
            continue
        if found is not None:
            return dataclasses.replace(lora_request, lora_path=found.lora_path)
    return lora_request
