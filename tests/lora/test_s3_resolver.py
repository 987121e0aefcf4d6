"""The S3 resolver against a real S3 endpoint (moto's standalone server, real boto3): found and cached
once per process, single flight, verified downloads (sizes, SHA256SUMS), names kept inside the
prefix, unknown names remembered for a while, an unreachable store reported as such."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.harness import wait_for
from support.moto_s3 import FAKE_AWS_ENV, MotoS3, closed_port_url, moto_s3_server, upload_adapter

from loraserve.errors import LoRAAdapterBaseMismatchError, LoRAAdapterError, LoRAAdapterUnavailableError
from loraserve.lora.resolver import LoRAResolverRegistry
from loraserve.lora.resolvers.s3_config import S3StoreConfig
from loraserve.lora.resolvers.s3_resolver import RESOLVER_NAME, S3Resolver, register_s3_resolver
from loraserve.lora.resolvers.s3_store import S3AdapterStore

WEIGHTS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def s3() -> Iterator[MotoS3]:
    with pytest.MonkeyPatch.context() as mp:
        for key, value in FAKE_AWS_ENV.items():
            mp.setenv(key, value)
        with moto_s3_server() as server:
            yield server


@pytest.fixture(scope="module")
def peft_adapter(tiny_model: Any, hf_model: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A tiny real PEFT adapter folder for the tiny Llama: {"path", "base"}."""
    from loraserve.demo.random_model import save_peft_adapter

    base = tiny_model("llama")
    path = str(tmp_path_factory.mktemp("s3-src") / "adapter")
    save_peft_adapter(hf_model(base), path, 7, base, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    return {"path": path, "base": base}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclasses.dataclass
class Store:
    s3: MotoS3
    bucket: str
    cache_dir: str
    clock: Clock

    def make(self, **changes: Any) -> S3AdapterStore:
        """A new store (as in a new process) on this bucket and cache folder."""
        fields = dict(bucket=self.bucket, cache_dir=self.cache_dir, prefix="team/loras", endpoint_url=self.s3.endpoint_url)
        return S3AdapterStore(S3StoreConfig(**{**fields, **changes}), clock=self.clock)

    def upload(self, name: str, folder: str, sums: dict[str, str] | None = None) -> None:
        upload_adapter(self.s3, self.bucket, f"team/loras/{name}", folder, sums)


@pytest.fixture()
def store(s3: MotoS3, tmp_path: Path) -> Store:
    return Store(s3, s3.new_bucket(), str(tmp_path / "cache"), Clock())


def resolve(resolver: S3Resolver, name: str, base: str) -> Any:
    return asyncio.run(resolver.resolve_lora(base, name))


def same_files(folder: str, source: str) -> bool:
    """The adapter's own files are byte-identical (PEFT's README.md is not fetched)."""
    return all(Path(folder, n).read_bytes() == Path(source, n).read_bytes() for n in ("adapter_config.json", WEIGHTS))


def test_found_then_served_from_cache(store: Store, peft_adapter: dict[str, str]) -> None:
    store.upload("sql", peft_adapter["path"])
    s3_store = store.make()
    found = resolve(S3Resolver(s3_store), "sql", peft_adapter["base"])
    assert found is not None and found.lora_name == "sql" and found.base_model_name == peft_adapter["base"]
    assert same_files(found.lora_path, peft_adapter["path"])
    assert (s3_store.num_listings, s3_store.num_downloads) == (1, 1)
    # Gone from the bucket: this process still has its verified copy and asks the store nothing.
    for name in os.listdir(peft_adapter["path"]):
        store.s3.client.delete_object(Bucket=store.bucket, Key=f"team/loras/sql/{name}")
    again = resolve(S3Resolver(s3_store), "sql", peft_adapter["base"])
    assert again is not None and again.lora_path == found.lora_path
    assert (s3_store.num_listings, s3_store.num_downloads) == (1, 1)
    # Another base model: the adapter is found but not for it (the client's 400 says so).
    with pytest.raises(LoRAAdapterBaseMismatchError, match="base_model_name_or_path"):
        resolve(S3Resolver(s3_store), "sql", "org/other-base")


def test_new_process_reuses_complete_copy_and_replaces_broken_one(store: Store, peft_adapter: dict[str, str]) -> None:
    store.upload("sql", peft_adapter["path"])
    first = store.make().get("sql")
    assert first is not None
    second = store.make()
    assert second.get("sql") == first and (second.num_listings, second.num_downloads) == (1, 0)
    with open(os.path.join(first, WEIGHTS), "r+b") as f:
        f.truncate(10)  # a damaged local copy is never trusted
    third = store.make()
    assert third.get("sql") == first and third.num_downloads == 1
    assert same_files(first, peft_adapter["path"])
    # A new upload under the name is a new version in its own folder; the old files stay untouched.
    store.s3.client.put_object(Bucket=store.bucket, Key=f"team/loras/sql/{WEIGHTS}", Body=b"changed")
    newer = store.make().get("sql")
    assert newer is not None and newer != first and same_files(first, peft_adapter["path"])


def test_single_flight(store: Store, peft_adapter: dict[str, str]) -> None:
    store.upload("sql", peft_adapter["path"])
    s3_store = store.make()
    num_callers = 6
    fetches: list[str] = []
    fetch = s3_store.fetch

    def slow_fetch(lora_name: str, listing: Any) -> str:
        fetches.append(lora_name)
        wait_for(lambda: s3_store.num_waiting(lora_name) == num_callers - 1, what="every caller to wait")
        return fetch(lora_name, listing)

    s3_store.fetch = slow_fetch  # type: ignore[method-assign]
    results: list[Any] = []
    threads = [threading.Thread(target=lambda: results.append(s3_store.get("sql"))) for _ in range(num_callers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(results) == num_callers and len(set(results)) == 1 and results[0] is not None
    assert fetches == ["sql"] and (s3_store.num_listings, s3_store.num_downloads) == (1, 1)


def test_size_mismatch_refused(store: Store, peft_adapter: dict[str, str]) -> None:
    store.upload("sql", peft_adapter["path"])
    s3_store = store.make()
    listing = s3_store.list_adapter("sql")
    assert listing is not None and set(listing) == {"adapter_config.json", WEIGHTS}
    # The object changes between the listing and the download.
    store.s3.client.put_object(Bucket=store.bucket, Key=f"team/loras/sql/{WEIGHTS}", Body=b"short")
    with pytest.raises(LoRAAdapterError, match=f"LoRA adapter 'sql': {WEIGHTS} from the S3 store has 5 bytes"):
        s3_store.fetch("sql", listing)
    leftovers = [path for path in Path(store.cache_dir).rglob("*") if path.is_file()]
    assert leftovers == []  # nothing half-written is left to be trusted later


def test_sha256sums_checked(store: Store, peft_adapter: dict[str, str]) -> None:
    store.upload("good", peft_adapter["path"], sums={})
    store.upload("bad", peft_adapter["path"], sums={WEIGHTS: "0" * 64})
    config_digest = hashlib.sha256(Path(peft_adapter["path"], "adapter_config.json").read_bytes()).hexdigest()
    for name, sums in (("unlisted", f"{config_digest}  adapter_config.json\n"), ("malformed", "0000 x\n")):
        store.upload(name, peft_adapter["path"])
        store.s3.client.put_object(Bucket=store.bucket, Key=f"team/loras/{name}/SHA256SUMS", Body=sums.encode())
    s3_store = store.make()
    good = s3_store.get("good")
    assert good is not None and same_files(good, peft_adapter["path"])
    with pytest.raises(LoRAAdapterError, match=f"'bad': {WEIGHTS} from the S3 store does not match its sha256 in SHA256SUMS"):
        s3_store.get("bad")
    with pytest.raises(LoRAAdapterError, match=f"'unlisted': SHA256SUMS does not list {WEIGHTS}"):
        s3_store.get("unlisted")
    with pytest.raises(LoRAAdapterError, match="'malformed': SHA256SUMS line 1 is not"):
        s3_store.get("malformed")
    listings = s3_store.num_listings
    with pytest.raises(LoRAAdapterError, match="'bad'"):  # remembered: the store is not asked again
        s3_store.get("bad")
    assert s3_store.num_listings == listings
    # Only the good adapter was published; the refused downloads left nothing behind.
    assert [path.parent for path in Path(store.cache_dir).rglob(WEIGHTS)] == [Path(good)]


def test_size_limits(store: Store, peft_adapter: dict[str, str], tmp_path: Path) -> None:
    store.upload("sql", peft_adapter["path"])
    with pytest.raises(LoRAAdapterError, match="more than the limit of 100"):
        store.make(max_adapter_bytes=100).get("sql")
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    (config_only / "adapter_config.json").write_text("{}")
    store.upload("no-weights", str(config_only))
    with pytest.raises(LoRAAdapterError, match="'no-weights': the S3 store has its adapter_config.json but no weights"):
        store.make().get("no-weights")


def test_names_stay_inside_the_prefix(store: Store, peft_adapter: dict[str, str]) -> None:
    store.upload("sql", peft_adapter["path"])
    store.upload("team/nested", peft_adapter["path"])
    upload_adapter(store.s3, store.bucket, "team/outside", peft_adapter["path"])
    s3_store = store.make()
    for name in ("../outside", "sql/..", "/sql", "", "sql//x", "./sql", "sq\\l", "sql\x00", ".", "..", "x" * 1100):
        assert s3_store.get(name) is None, name
    assert s3_store.num_listings == 0  # refused before any request
    assert s3_store.get("sq") is None  # a key prefix of another name is not that name
    assert s3_store.get("team") is None  # a folder that only holds another adapter
    assert s3_store.get("team/nested") is not None


def test_unknown_names_remembered_for_ttl(store: Store, peft_adapter: dict[str, str]) -> None:
    s3_store = store.make(negative_ttl_s=60)
    assert s3_store.get("ghost") is None and s3_store.num_listings == 1
    store.upload("ghost", peft_adapter["path"])
    assert s3_store.get("ghost") is None and s3_store.num_listings == 1
    store.clock.now += 60
    assert s3_store.get("ghost") is not None and s3_store.num_listings == 2
    uncached = store.make(negative_ttl_s=0)
    assert uncached.get("nobody") is None and uncached.get("nobody") is None and uncached.num_listings == 2


def test_unreachable_store(store: Store, caplog: pytest.LogCaptureFixture) -> None:
    url = closed_port_url()
    s3_store = store.make(endpoint_url=url, connect_timeout_s=1.0, read_timeout_s=1.0, max_attempts=2)
    for _ in range(2):  # not remembered: each request asks the store again
        with caplog.at_level(logging.WARNING), pytest.raises(LoRAAdapterUnavailableError) as info:
            s3_store.get("sql")
        message = str(info.value)
        assert "LoRA adapter 'sql'" in message and "EndpointConnectionError" in message
        assert url not in message and store.bucket not in message  # the address stays in the log
    assert s3_store.num_listings == 2 and url in caplog.text


def test_register_s3_resolver(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog) -> None:
    for var in ("PLUGINS", "LORA_RESOLVER_S3_BUCKET", "LORA_RESOLVER_S3_MAX_ATTEMPTS"):
        monkeypatch.delenv("LORASERVE_" + var, raising=False)
        monkeypatch.delenv("VLLM_" + var, raising=False)
    monkeypatch.setattr(LoRAResolverRegistry, "resolvers", {})
    register_s3_resolver()
    assert LoRAResolverRegistry.get_supported_resolvers() == []
    monkeypatch.setenv("LORASERVE_PLUGINS", "lora_s3_resolver")
    with caplog.at_level(logging.WARNING):
        register_s3_resolver()
    assert "LORASERVE_LORA_RESOLVER_S3_BUCKET is not set" in caplog.text
    monkeypatch.setenv("VLLM_LORA_RESOLVER_S3_BUCKET", "my-bucket")
    monkeypatch.setenv("LORASERVE_LORA_RESOLVER_S3_PREFIX", "/loras/")
    monkeypatch.setenv("LORASERVE_LORA_RESOLVER_S3_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("LORASERVE_LORA_RESOLVER_S3_MAX_ATTEMPTS", "many")
    with pytest.raises(ValueError, match="LORASERVE_LORA_RESOLVER_S3_MAX_ATTEMPTS"):
        register_s3_resolver()
    monkeypatch.setenv("LORASERVE_LORA_RESOLVER_S3_MAX_ATTEMPTS", "5")
    register_s3_resolver()
    resolver = LoRAResolverRegistry.get_resolver(RESOLVER_NAME)
    assert isinstance(resolver, S3Resolver)
    config = resolver.store.config
    assert (config.bucket, config.prefix, config.cache_dir, config.max_attempts) == ("my-bucket", "loras/", str(tmp_path), 5)


def test_entry_point_declared() -> None:
    pyproject = Path(__file__).parents[2] / "pyproject.toml"
    assert 'lora_s3_resolver = "loraserve.lora.resolvers.s3_resolver:register_s3_resolver"' in pyproject.read_text()
