"""Paged KV-cache blocks with reference counts and a prefix cache (vLLM's automatic prefix caching).

A full block is identified by xxhash64 over (hash of the previous block, its token ids), so
equal hashes mean equal prefixes; a sequence that runs a LoRA adapter starts its chain from its
adapter's hash, so its K/V (which the adapter changes) are found only by sequences of the same
adapter. A hit is still checked against the block's stored token ids and adapter, so a hash
collision is never served. A freed block keeps its hash (and stays findable) until
the free list hands it out again, oldest-freed first.
"""
from array import array
from collections import OrderedDict

import xxhash

from nanovllm.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "lora_int_id")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.token_ids: list[int] | None = None
        self.lora_int_id = 0  # the adapter of the sequence that computed it (0: none)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block_id: dict[int, int] = {}

    @staticmethod
    def compute_hash(token_ids: list[int], prefix_hash: int = -1) -> int:
        h = xxhash.xxh64()
        if prefix_hash != -1:
            h.update(prefix_hash.to_bytes(8, "little"))
        h.update(array("q", token_ids).tobytes())
        return h.intdigest()

    @staticmethod
    def root_hash(seq: Sequence) -> int:
        """The hash that `seq`'s chain of block hashes starts from: -1, or its LoRA adapter's."""
        if not seq.lora_int_id:
            return -1
        return xxhash.xxh64(b"lora" + seq.lora_int_id.to_bytes(8, "little")).intdigest()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def find_cached_blocks(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of `seq`'s tokens. The last token is never
        included, so the step that admits `seq` always has at least one token to compute."""
        if not self.enable_prefix_caching or seq.sampling_params.prompt_logprobs is not None:
            return []  # (prompt logprobs need every prompt token's logits)
        hits, prefix_hash, bs = [], self.root_hash(seq), self.block_size
        for i in range((len(seq) - 1) // bs):
            tokens = seq.token_ids[i * bs:(i + 1) * bs]
            prefix_hash = self.compute_hash(tokens, prefix_hash)
            block_id = self.hash_to_block_id.get(prefix_hash)
            if (block_id is None or self.blocks[block_id].token_ids != tokens
                    or self.blocks[block_id].lora_int_id != seq.lora_int_id):
                break
            hits.append(block_id)
        return hits

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, cached_block_ids: list[int] = ()) -> bool:
        """Give `seq` blocks for `num_new_tokens` more tokens after its computed ones, first taking
        `cached_block_ids` (from find_cached_blocks, for a sequence that holds no blocks yet).
        Returns False, changing nothing, when too few blocks are free."""
        reused_free = sum(1 for b in cached_block_ids if self.blocks[b].ref_count == 0)
        num_computed = seq.num_computed_tokens + len(cached_block_ids) * self.block_size
        new_blocks = self.blocks_needed(num_computed + num_new_tokens) - len(seq.block_table) - len(cached_block_ids)
        if reused_free + max(new_blocks, 0) > self.num_free_blocks:
            return False
        for block_id in cached_block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        if cached_block_ids:
            seq.num_hashed_blocks = len(cached_block_ids)
        for _ in range(new_blocks):
            seq.block_table.append(self._take_free_block())
        return True

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        self._forget_hash(block)  # evict its prefix-cache entry
        block.ref_count = 1
        return block_id

    def _forget_hash(self, block: Block):
        """Take `block` out of the prefix cache (the map keeps an equal block registered first)."""
        if block.hash != -1:
            if self.hash_to_block_id.get(block.hash) == block.block_id:
                del self.hash_to_block_id[block.hash]
            block.hash, block.token_ids = -1, None

    def cache_full_blocks(self, seq: Sequence, num_known_tokens: int):
        """Register in the prefix cache every block of `seq` full of computed tokens among the
        first `num_known_tokens` (the ones whose values are on the host)."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(seq.num_computed_tokens, num_known_tokens) // bs
        for i in range(seq.num_hashed_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            prefix_hash = self.blocks[seq.block_table[i - 1]].hash if i > 0 else self.root_hash(seq)
            block.token_ids, block.lora_int_id = seq.token_ids[i * bs:(i + 1) * bs], seq.lora_int_id
            block.hash = self.compute_hash(block.token_ids, prefix_hash)
            self.hash_to_block_id.setdefault(block.hash, block.block_id)
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, num_full)

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None | bool:
        """Give `child` the KV of `parent`, whose tokens are all computed: its full blocks shared (one
        more reference each), its last block, when partial, copied into a new block (the two will
        write different tokens into it). Returns the (source, destination) block pair to copy, None
        when there is nothing to copy, False (nothing changed) when no block is free for it."""
        full = len(parent) // self.block_size
        partial = len(parent.block_table) > full
        if partial and not self.free_block_ids:
            return False
        for block_id in parent.block_table[:full]:
            self.blocks[block_id].ref_count += 1
        child.block_table = parent.block_table[:full]
        child.num_hashed_blocks = min(parent.num_hashed_blocks, full)
        if not partial:
            return None
        child.block_table.append(self._take_free_block())
        return parent.block_table[full], child.block_table[-1]

    def truncate(self, seq: Sequence, num_tokens: int):
        """Drop `seq`'s KV past its first num_tokens tokens (its token_ids are the caller's): blocks
        wholly past them go back, tail first (to the free list where no one else holds them), and
        num_computed_tokens drops to num_tokens at most. A block ending inside them stays when seq
        alone holds it; when shared (a prefix-cache hit, a fork's), seq gives it back and computes
        its kept tokens again (num_computed_tokens drops to its start), since seq would write the
        next tokens into it. Blocks whose hash covered a dropped token leave the prefix cache:
        the one kept (it will hold other tokens) and those freed; one that others still hold keeps
        it (it still holds their tokens)."""
        bs = self.block_size
        keep = min(self.blocks_needed(num_tokens), len(seq.block_table))
        if keep * bs > num_tokens and self.blocks[seq.block_table[keep - 1]].ref_count > 1:
            keep -= 1
        for block_id in reversed(seq.block_table[keep:]):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._forget_hash(block)
                self.free_block_ids[block_id] = None
        del seq.block_table[keep:]
        if keep * bs > num_tokens:  # the kept block past num_tokens, seq's alone
            self._forget_hash(self.blocks[seq.block_table[-1]])
        seq.num_hashed_blocks = min(seq.num_hashed_blocks, num_tokens // bs, keep)
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_tokens, keep * bs)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (as vLLM's reset_prefix_cache); only when no block is in use.
        Returns whether it was reset."""
        if self.num_free_blocks != len(self.blocks):
            return False
        for block in self.blocks:
            block.hash, block.token_ids = -1, None
        self.hash_to_block_id.clear()
        return True

    def free(self, seq: Sequence):
        """Drop `seq`'s references; blocks no one holds go to the free list, tail blocks first so
        that a shared prefix is evicted last."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        seq.block_table = []
        seq.num_hashed_blocks = 0
