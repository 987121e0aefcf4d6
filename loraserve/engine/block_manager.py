"""Paged KV-cache block allocation with a prefix cache keyed by token content and adapter identity.

A full block is identified by a chained hash: (hash of the previous block, its token ids, the
request's cache salt, and the content hash and position of each image whose placeholder tokens it
holds). The salt is the adapter's content digest (None for the base model), so the same prompt under
two adapters, or under one name with new weights, never shares KV; the same placeholder tokens with
another image never do either. Blocks whose reference count drops to zero stay cached (LRU) until
their memory is needed.

A fresh adapter's digest is still being hashed when its first request is scheduled (the request does
not wait for it): until it is known, that request's blocks neither reuse the cache nor enter it; they
are committed on the first step after the digest is done, or, for a request that ends sooner, when it
ends (the step waits for the rest of that one hash, so a short first request still fills the cache).

It reads sequences and hands out block ids; the scheduler records them on the sequence.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable
from collections.abc import Sequence as Seq

from loraserve.engine.sequence import CacheSalt, Sequence


def salt_key(salt: CacheSalt | None, wait: bool = False) -> str | None:
    """The salt's text ("" for the base model), or None while the adapter's digest is unknown (unless
    `wait`) or could not be computed (its blocks then never enter the cache, and nothing else fails)."""
    if salt is None:
        return ""
    if not wait and not salt.done():
        return None
    try:
        return salt.result()
    except Exception:  # noqa: BLE001 - a failed hash only costs this adapter its prefix caching
        return None


def block_hash(parent: bytes | None, token_ids: Seq[int], salt: str | None, images: bytes = b"") -> bytes:
    """sha256 over (parent digest, the block's token ids, salt, its images' hashes and positions):
    collisions cannot be crafted."""
    h = hashlib.sha256(parent or b"root")
    h.update(array("q", token_ids).tobytes())  # fixed width per token, so the encoding is unambiguous
    h.update(b"|" + (salt or "").encode())
    if images:
        h.update(b"|images:" + images)
    return h.digest()


def _seq_block_hash(seq: Sequence, index: int, block_size: int, parent: bytes | None, salt: str) -> bytes:
    start, end = index * block_size, (index + 1) * block_size
    mm = getattr(seq.request, "mm", None)
    images = mm.block_key(start, end) if mm is not None else b""
    return block_hash(parent, seq.token_ids[start:end], salt, images)


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        rope_switch_length: int | None = None,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # LongRoPE models (`KVCacheSpec.rope_switch_length`): a sequence longer than this when it is
        # (re)admitted computes every block on the long factors, so its blocks are salted apart.
        self.rope_switch_length = rope_switch_length
        self.long_rope_seqs: set[int] = set()
        self.ref_counts = [0] * num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.cached: dict[bytes, int] = {}  # block hash -> block id
        self.hash_of: dict[int, bytes] = {}  # block id -> block hash
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks with ref count 0 (LRU)
        self.seq_hashes: dict[int, list[bytes]] = {}  # seq id -> hashes of its full computed blocks
        self.num_prefix_hits = 0
        self.num_prefix_queries = 0
        self.num_prefix_query_tokens = 0  # vLLM's units: prompt tokens looked up, and found
        self.num_prefix_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids) + len(self.evictable)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_ids))

    def allocate(self, seq: Sequence, num_new_tokens: int) -> list[int] | None:
        """The new blocks `seq` needs to hold `num_new_tokens` more tokens; None (and no change) if short."""
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed > self.num_free_blocks:
            return None
        return [self._take_block() for _ in range(needed)]

    def _take_block(self) -> int:
        if self.free_ids:
            block = self.free_ids.popleft()
        else:
            block, _ = self.evictable.popitem(last=False)
            del self.cached[self.hash_of.pop(block)]
        self.ref_counts[block] = 1
        return block

    def reuse_cached_prefix(self, seq: Sequence, cache_salt: CacheSalt | None) -> list[int]:
        """The blocks of the longest cached prefix of a fresh sequence, now referenced by it.

        At least one token is always left to compute, since the last position's logits are needed.
        """
        hashes: list[bytes] = []
        block_ids: list[int] = []
        self.long_rope_seqs.discard(seq.seq_id)
        if self.rope_switch_length is not None and seq.num_tokens > self.rope_switch_length:
            self.long_rope_seqs.add(seq.seq_id)
        salt = self._salt(seq, cache_salt)
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None or salt is None:
            self.seq_hashes[seq.seq_id] = hashes
            return block_ids
        self.num_prefix_queries += 1
        max_blocks = (seq.num_tokens - 1) // self.block_size
        parent: bytes | None = None
        for i in range(max_blocks):
            h = _seq_block_hash(seq, i, self.block_size, parent, salt)
            block = self.cached.get(h)
            if block is None:
                break
            if self.ref_counts[block] == 0:
                self.evictable.pop(block, None)
            self.ref_counts[block] += 1
            block_ids.append(block)
            hashes.append(h)
            parent = h
        self.seq_hashes[seq.seq_id] = hashes
        self.num_prefix_query_tokens += seq.num_tokens
        self.num_prefix_hit_tokens += len(block_ids) * self.block_size
        if hashes:
            self.num_prefix_hits += 1
        return block_ids

    def commit_computed(self, seq: Sequence, cache_salt: CacheSalt | None, ending: bool = False) -> None:
        """Register every newly full, computed block of `seq` in the prefix cache (none while the
        salt is unknown: a later call catches up; an `ending` sequence has no later call, so it
        waits for the digest)."""
        if not self.enable_prefix_caching:
            return
        salt = self._salt(seq, cache_salt, ending)
        if salt is None:
            return
        hashes = self.seq_hashes.setdefault(seq.seq_id, [])
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        while len(hashes) < num_full:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            h = _seq_block_hash(seq, i, self.block_size, parent, salt)
            hashes.append(h)
            block = seq.block_ids[i]
            if h not in self.cached and block not in self.hash_of:
                self.cached[h] = block
                self.hash_of[block] = h

    def fork(self, parent: Sequence, child_seq_id: int) -> list[int]:
        """A beam forked from `parent`: it holds the same blocks (one more reference each; the last,
        partial one is copied when either writes to it, `copy_on_write`) and continues its prefix-cache
        chain; returns the child's block table."""
        for block in parent.block_ids:
            self.ref_counts[block] += 1
        self.seq_hashes[child_seq_id] = list(self.seq_hashes.get(parent.seq_id, []))
        if parent.seq_id in self.long_rope_seqs:  # same rope factors as its parent's blocks
            self.long_rope_seqs.add(child_seq_id)
        return list(parent.block_ids)

    def shared_write_block(self, seq: Sequence) -> int | None:
        """The index in `seq.block_ids` of the partial block its next computed token is written into,
        when another sequence (a sibling beam) holds that block too; else None."""
        if seq.num_computed_tokens % self.block_size == 0:
            return None  # the next token starts a new block of its own
        i = seq.num_computed_tokens // self.block_size
        if i < len(seq.block_ids) and self.ref_counts[seq.block_ids[i]] > 1:
            return i
        return None

    def copy_on_write(self, block: int) -> int:
        """A private block to hold a copy of the shared `block` (the caller copies the KV and records
        it in place of `block`, which loses one reference but stays held by its other sequences)."""
        if self.num_free_blocks == 0:
            raise RuntimeError("no free KV block for a copy on write")
        self.ref_counts[block] -= 1
        return self._take_block()

    def _salt(self, seq: Sequence, cache_salt: CacheSalt | None, wait: bool = False) -> str | None:
        salt = salt_key(cache_salt, wait)
        return salt + "|long-rope" if salt is not None and seq.seq_id in self.long_rope_seqs else salt

    def release_tail(self, block_ids: list[int], keep: int) -> list[int]:
        """Drop a sequence's references to its blocks after the first `keep` (speculative decoding's
        rejected proposals: never committed, since they are past its computed tokens); returns the
        blocks it keeps, which the caller records."""
        for block in reversed(block_ids[keep:]):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if block in self.hash_of:
                    self.evictable[block] = None
                else:
                    self.free_ids.append(block)
        return block_ids[:keep]

    def free(self, seq: Sequence) -> None:
        """Release a finished or preempted sequence's blocks (cached ones stay reusable); the caller
        then forgets them."""
        self.release_tail(seq.block_ids, 0)
        self.seq_hashes.pop(seq.seq_id, None)
        self.long_rope_seqs.discard(seq.seq_id)

    def check_consistency(self, block_tables: Iterable[list[int]]) -> str | None:
        """What is wrong with the bookkeeping, given the block ids every live sequence holds; None if
        each block is exactly one of free, evictable (cached, unused) or referenced as often as held."""
        held = [0] * self.num_blocks
        for table in block_tables:
            for block in table:
                held[block] += 1
        if held != self.ref_counts:
            wrong = [b for b in range(self.num_blocks) if held[b] != self.ref_counts[b]]
            return f"reference counts disagree with the sequences' block tables for blocks {wrong[:8]}"
        free, evictable = set(self.free_ids), set(self.evictable)
        unused = {b for b in range(self.num_blocks) if held[b] == 0}
        if len(free) != len(self.free_ids) or free & evictable or free | evictable != unused:
            return "free and evictable blocks are not exactly the unreferenced ones"
        if not evictable <= self.hash_of.keys():
            return "an evictable block is not in the prefix cache"
        return None
