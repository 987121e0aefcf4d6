"""A replica on another node than the ingress fetches an adapter through its own resolvers (the S3 store
read once per replica), keeping the id and name the ingress gave it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from loraserve.entrypoints.ray.replica_adapters import local_adapter
from loraserve.lora.request import LoRARequest
from loraserve.lora.resolver import LoRAResolver, LoRAResolverRegistry


class FolderResolver(LoRAResolver):
    """Finds adapter `name` in `root/name` and records who asked."""

    def __init__(self, root: Path) -> None:
        self.root, self.asked = root, []  # type: ignore[var-annotated]

    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        self.asked.append((base_model_name, lora_name))
        folder = self.root / lora_name
        return LoRARequest(lora_name, 1, str(folder)) if folder.is_dir() else None


@pytest.fixture
def resolver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FolderResolver]:
    monkeypatch.setenv("LORASERVE_ALLOW_RUNTIME_LORA_UPDATING", "true")
    found = FolderResolver(tmp_path / "replica-cache")
    (tmp_path / "replica-cache" / "sql").mkdir(parents=True)
    LoRAResolverRegistry.register_resolver("test_replica_folder", found)
    yield found
    LoRAResolverRegistry.unregister_resolver("test_replica_folder")


def test_a_folder_missing_here_is_fetched_by_name(resolver: FolderResolver, tmp_path: Path) -> None:
    sent = LoRARequest("sql", 7, str(tmp_path / "ingress-cache" / "sql"))  # the ingress machine's folder
    local = asyncio.run(local_adapter(sent, "base-model"))
    assert local.lora_path == str(tmp_path / "replica-cache" / "sql")
    assert (local.lora_name, local.lora_id) == ("sql", 7)  # the ingress's identity is kept
    assert resolver.asked == [("base-model", "sql")]


def test_a_folder_present_here_or_a_repo_id_is_left_alone(resolver: FolderResolver, tmp_path: Path) -> None:
    here = tmp_path / "shared" / "sql"
    here.mkdir(parents=True)
    for sent in (LoRARequest("sql", 7, str(here)), LoRARequest("sql", 7, "org/sql-adapter")):
        assert asyncio.run(local_adapter(sent, "base-model")) is sent
    assert resolver.asked == []


def test_a_name_no_resolver_finds_goes_on_unchanged(resolver: FolderResolver, tmp_path: Path) -> None:
    sent = LoRARequest("gone", 3, str(tmp_path / "ingress-cache" / "gone"))
    assert asyncio.run(local_adapter(sent, "base-model")) is sent  # the engine names the missing files


def test_resolvers_are_not_asked_when_runtime_loading_is_off(
    resolver: FolderResolver, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORASERVE_ALLOW_RUNTIME_LORA_UPDATING", "false")
    sent = LoRARequest("sql", 7, str(tmp_path / "ingress-cache" / "sql"))
    assert asyncio.run(local_adapter(sent, "base-model")) is sent
    assert resolver.asked == []
