"""Fixed pool of KV blocks: per-request block tables, ref counts, prefix caching by hash chain."""

from __future__ import annotations

from collections import OrderedDict

from sluice.engine.request import Request


class Block:
    """One KV block: its ref count and, once full and cached, its hash and tokens."""

    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()


class BlockManager:
    """Hands out blocks; freed blocks keep their cached contents until evicted (LRU)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        # a block's record is made when it is first handed out (a pool of ten thousands costs its start
        # otherwise): every other lookup is of a block some table holds
        self.blocks: list[Block] = [None] * num_blocks  # type: ignore[list-item]
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.num_hashed: dict[str, int] = {}
        self.queries = 0
        self.hits = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    @staticmethod
    def chain_hash(parent: int | None, token_ids: tuple[int, ...]) -> int:
        """Hash of a full block given its parent block's hash."""
        return hash((parent, token_ids))

    def _take_free_block(self) -> Block:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block is None:
            block = self.blocks[block_id] = Block(block_id)
        if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
            del self.hash_to_block[block.hash]
        block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block

    def _acquire_cached(self, block: Block) -> None:
        if block.ref_count == 0:
            del self.free_blocks[block.block_id]
        block.ref_count += 1

    def match_prefix(self, req: Request) -> int:
        """Attach cached blocks for the request's leading full blocks; return tokens covered."""
        assert not req.block_table
        if not self.enable_prefix_caching:
            return 0
        tokens = req.all_token_ids
        num_full = (len(tokens) - 1) // self.block_size
        parent: int | None = req.cache_salt  # a salted request shares blocks only with its own salt
        for i in range(num_full):
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            h = self.chain_hash(parent, chunk)
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            self._acquire_cached(self.blocks[block_id])
            req.block_table.append(block_id)
            parent = h
        self.num_hashed[req.request_id] = len(req.block_table)
        self.queries += len(tokens)
        self.hits += len(req.block_table) * self.block_size
        return len(req.block_table) * self.block_size

    def blocks_needed(self, req: Request, num_new_tokens: int) -> int:
        """Extra blocks the request needs to hold `num_new_tokens` more computed tokens."""
        total = req.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(req.block_table))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free_blocks)

    def allocate(self, req: Request, num_new_tokens: int) -> None:
        """Grow the block table so it covers num_computed + num_new tokens."""
        needed = self.blocks_needed(req, num_new_tokens)
        assert needed <= len(self.free_blocks), "allocate without can_allocate"
        for _ in range(needed):
            req.block_table.append(self._take_free_block().block_id)

    def cache_full_blocks(self, req: Request) -> None:
        """Register the hashes of blocks that became full of computed, final tokens."""
        if not self.enable_prefix_caching:
            return
        done = self.num_hashed.get(req.request_id, 0)
        num_full = min(req.num_computed_tokens, req.num_tokens) // self.block_size
        if num_full <= done:
            return
        tokens = req.all_token_ids
        parent = self.blocks[req.block_table[done - 1]].hash if done else req.cache_salt
        for i in range(done, num_full):
            block = self.blocks[req.block_table[i]]
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            h = self.chain_hash(parent, chunk)
            if block.hash is None:
                block.hash, block.token_ids = h, chunk
                self.hash_to_block.setdefault(h, block.block_id)
            parent = h
        self.num_hashed[req.request_id] = num_full

    def trim(self, req: Request, num_tokens: int) -> None:
        """Release tail blocks beyond those holding `num_tokens` tokens (rejected speculative slots)."""
        keep = -(-num_tokens // self.block_size)
        while len(req.block_table) > keep:
            block = self.blocks[req.block_table.pop()]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[block.block_id] = None
                self.free_blocks.move_to_end(block.block_id, last=block.hash is not None)
        self.num_hashed[req.request_id] = min(self.num_hashed.get(req.request_id, 0), len(req.block_table))

    def free(self, req: Request) -> None:
        """Release the request's blocks, tail first, so the tail is evicted first."""
        for block_id in reversed(req.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
                if block.hash is None:
                    self.free_blocks.move_to_end(block_id, last=False)
        req.block_table = []
        self.num_hashed.pop(req.request_id, None)

    @property
    def hit_rate(self) -> float:
        """Fraction of looked-up prompt tokens served from the prefix cache."""
        return self.hits / self.queries if self.queries else 0.0
