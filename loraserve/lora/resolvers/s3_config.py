"""`S3StoreConfig`: where the S3 adapter store is and how patiently it is read (no boto3 needed here).

Read from LORASERVE_LORA_RESOLVER_S3_* (VLLM_* accepted) by `from_env`. The store's layout: adapter
`N` is the objects `<prefix>/N/adapter_config.json` and `<prefix>/N/adapter_model.safetensors` (or
`.bin` / `.pt`), optionally with `<prefix>/N/SHA256SUMS` (sha256sum's format) beside them.
"""

from __future__ import annotations

from dataclasses import dataclass

from loraserve import envs

DEFAULT_MAX_ADAPTER_BYTES = 4 << 30


@dataclass(frozen=True, slots=True)
class S3StoreConfig:
    bucket: str
    cache_dir: str
    prefix: str = ""  # normalized: no leading slash, and a trailing one unless empty
    endpoint_url: str | None = None
    region: str | None = None
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 30.0
    max_attempts: int = 3  # botocore's standard retry mode: the first try included
    negative_ttl_s: float = 30.0  # how long "not in the store" (or "broken there") is believed
    max_adapter_bytes: int = DEFAULT_MAX_ADAPTER_BYTES  # all files of one adapter together

    def __post_init__(self) -> None:
        if not self.bucket:
            raise ValueError("the S3 adapter store needs a bucket (LORASERVE_LORA_RESOLVER_S3_BUCKET)")
        prefix = self.prefix.strip("/")
        object.__setattr__(self, "prefix", f"{prefix}/" if prefix else "")

    @property
    def location(self) -> str:
        """The store as an s3:// URL (for logs; never sent to clients)."""
        return f"s3://{self.bucket}/{self.prefix}"

    @classmethod
    def from_env(cls) -> S3StoreConfig | None:
        """The configured store, None when LORASERVE_LORA_RESOLVER_S3_BUCKET is unset; ValueError
        naming the variable when a number is malformed."""
        bucket = envs.lora_resolver_s3_bucket()
        if bucket is None:
            return None
        number = envs.lora_resolver_s3_number
        return cls(
            bucket=bucket,
            cache_dir=envs.lora_resolver_s3_cache_dir(),
            prefix=envs.lora_resolver_s3_prefix(),
            endpoint_url=envs.lora_resolver_s3_endpoint_url(),
            region=envs.lora_resolver_s3_region(),
            connect_timeout_s=number("CONNECT_TIMEOUT", 5.0, 0.001),
            read_timeout_s=number("READ_TIMEOUT", 30.0, 0.001),
            max_attempts=int(number("MAX_ATTEMPTS", 3, 1)),
            negative_ttl_s=number("NEGATIVE_TTL", 30.0, 0),
            max_adapter_bytes=int(number("MAX_ADAPTER_BYTES", DEFAULT_MAX_ADAPTER_BYTES, 1)),
        )
