"""The KV cache pool: preallocated from a memory budget, handed out in fixed-size blocks, full blocks of prompt
shared between requests through a prefix cache.

A request takes blocks in one of two ways (the scheduler's admission, server/scheduler.py, decides which):

- on demand (the default): its prompt's blocks when admitted, then one more block whenever its next token starts
  one (:meth:`BlockPool.grow`); when none is left the scheduler preempts a request to free some;
- reserved: every block it can ever need at once, (prompt + max_new_tokens) tokens rounded up to whole blocks, so
  it never needs another and is never preempted.

Either way its blocks go back the moment it finishes, is cancelled or is preempted. Of its prompt's blocks, the
ones holding a run of tokens that an earlier request already wrote are not taken anew: they are mapped from the
prefix cache (:class:`BlockPool`), and the request's prefill starts after them. Its accounting then says which of
its blocks it shared (with the cache or another live request) and which it owned.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import torch

from quant.runtime.kv_quant import CODE_DTYPES, POOL_FORMATS
from quant.shape.kv_formats import FORMATS, token_bytes
from quant.shape.model import ModelShape
from server import kv_int4

SERVED_FORMATS = (*POOL_FORMATS, "int4")  # the quantized formats a pool holds (int4: server/kv_int4.py)


def default_block_size(kv_format: str | None) -> int:
    """Tokens per block when none is asked for: 16, or int4's key group."""
    return kv_int4.BLOCK_SIZE if kv_format == "int4" else 16


class KVBudgetError(ValueError):
    """The budget cannot hold even one block, or is not a valid size."""


@dataclass(frozen=True)
class KVLayout:
    """The pool's shape: K and V of ``layers`` x ``kv_heads`` x ``head_dim`` per token, in blocks of ``block_size``
    tokens, held in the activations' ``dtype`` or, with ``kv_format`` (one of quant.runtime.kv_quant.POOL_FORMATS),
    as codes with a float16 scale per token per KV head; or ``int4`` (server/kv_int4.py): blocks of its key group
    and a residual tail per sequence, two block-sized units."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int = 16
    kv_format: str | None = None

    def __post_init__(self):
        if self.kv_format is not None and self.kv_format not in SERVED_FORMATS:
            raise ValueError(f"the KV pool holds no format {self.kv_format!r}; it holds {', '.join(SERVED_FORMATS)}")
        if self.int4 and self.block_size != kv_int4.BLOCK_SIZE:
            raise ValueError(f"an int4 KV cache is held in blocks of its key group, {kv_int4.BLOCK_SIZE} tokens, "
                             f"not {self.block_size}")
        if self.int4 and self.head_dim % 8:
            raise ValueError(f"an int4 KV cache's kernels read head_dim in runs of 8 channels: {self.head_dim} is "
                             f"not a multiple of 8")

    @classmethod
    def from_config(cls, config, dtype: torch.dtype, block_size: int = 16, kv_format: str | None = None) -> "KVLayout":
        s = ModelShape.from_config(config)
        return cls(s.layers, s.kv_heads, s.head_dim, dtype, block_size, kv_format)

    @property
    def int4(self) -> bool:
        """The pool holds int4 blocks and residual tails (server/kv_int4.py)."""
        return self.kv_format == "int4"

    @property
    def tail_blocks(self) -> int:
        """Blocks a running sequence holds besides its table: int4's residual tail (its K half and its V half, a
        block-sized unit each); 0 for every other dtype."""
        return kv_int4.TAIL_UNITS if self.int4 else 0

    @property
    def kv_dtype(self) -> str:
        """What K and V are held in: the format's name, or the float dtype's ("bfloat16")."""
        return self.kv_format or str(self.dtype).removeprefix("torch.")

    @property
    def rotation(self) -> tuple[int, int]:
        """The blocks of the keys' and the values' Walsh-Hadamard rotation in a format that rotates them (int8), each
        0 where none (int4's kernels rotate its values themselves)."""
        if not self.kv_format or self.int4:
            return 0, 0
        fmt = FORMATS[self.kv_format]
        return fmt.key_block(self.head_dim), fmt.value_block(self.head_dim)

    @property
    def storage_dtype(self) -> torch.dtype:
        """The dtype of the pool's storage tensor: int4's bytes, the codes' for another format, else the
        activations'."""
        if self.int4:
            return torch.uint8
        return CODE_DTYPES[self.kv_format] if self.kv_format else self.dtype

    @property
    def bytes_per_token(self) -> int:
        """layers * kv_heads * (K and V of one head in kv_dtype, scales included: quant.shape.kv_formats)."""
        return self.layers * self.kv_heads * token_bytes(self.kv_dtype, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def sample_blocks(self, tokens: int) -> int:
        """Blocks one sequence of ``tokens`` positions holds: its table's and its tail's."""
        return self.blocks_for(tokens) + self.tail_blocks


def budget_fraction(spec: str | int | float) -> float | None:
    """The fraction a budget spec asks for ("0.3"), or None for a byte count."""
    text = str(spec).strip()
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0.0 < value < 1.0 and "." in text else None


def free_memory(device: torch.device | str = "cpu") -> int:
    """Bytes free on the device right now (CUDA: the driver's count; CPU: available RAM)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


def resolve_budget(spec: str | int | float, device: torch.device | str = "cpu") -> int:
    """Bytes for the pool: an integer byte count ("2147483648", "2GiB") or a fraction of the memory
    free right now ("0.3"). Invalid specs are errors, not silently clamped."""
    from quant.shape.memory import parse_bytes

    text = str(spec).strip()
    value = budget_fraction(text)
    if value is not None:
        return int(free_memory(device) * value)
    try:
        nbytes = parse_bytes(text)
    except ValueError as e:
        raise KVBudgetError(f"--memory-budget: {e}; or a fraction of free memory in (0, 1)") from e
    if nbytes <= 0:
        raise KVBudgetError(f"--memory-budget must be positive, got {spec!r}")
    return nbytes


def shared_blocks(prompt_tokens: int, block_size: int) -> int:
    """The prompt's blocks a request can share (mapped from the prefix cache, or between its samples): its full
    blocks before the block of its last token, whose logits must be computed."""
    return (prompt_tokens - 1) // block_size if prompt_tokens else 0


def group_blocks(prompt_tokens: int, tokens: int, n: int, block_size: int, tail_blocks: int) -> int:
    """Blocks a request of ``n`` samples of ``tokens`` each (prompt included) reserves with nothing cached: each
    sample's ceil(tokens / block_size) and its ``tail_blocks`` (KVLayout.tail_blocks), the :func:`shared_blocks`
    held once (BlockPool.try_reserve_group; the capacity plan counts with this too)."""
    total = math.ceil(tokens / block_size)
    return total + (n - 1) * (total - shared_blocks(prompt_tokens, block_size)) + n * tail_blocks


class BlockPool:
    """Fixed-size blocks of KV storage: all-or-nothing reservations per request that grow a block at a time, and a
    prefix cache of full blocks shared between requests (nano-vllm's block manager is the shape: a hash chain, reference counts, a free list).

    1. A full block of prompt tokens is keyed by a hash chain: its key digests its parent block's key, its token
       ids, and the pool's ``salt`` (what else decides its K/V: the model, the KV dtype, a LoRA identity).
    2. Every block has a reference count: the requests that hold it. A block no request holds is free or, when it
       is keyed, *cached*: kept with its K/V until its space is needed, then evicted least recently released first
       (a released request's deepest block first, so a chain is cut from its end). A held block is never evicted,
       and a block is written only by the request that took it fresh.
    3. :meth:`try_reserve` with the request's prompt maps the longest cached run of the prompt's full blocks, never
       the block holding its last token (whose logits must be computed: the last partial or full block is always
       the request's own), and takes fresh blocks for the rest, from the free list first, then by evicting cached
       blocks. All or nothing, and only when ``headroom`` blocks would still be free after it (the scheduler's
       watermark: room for the running requests' next blocks).
    4. :meth:`publish` keys a request's full prompt blocks as its prefill writes them, so later requests map them;
       a block whose key another block already holds (two requests prefilling the same prompt at once) stays
       unkeyed, the request's own.
    5. :meth:`grow` appends fresh blocks to a request's table (its decode reached a new block); all or nothing.
       A request also holds its layout's ``tail_blocks`` (int4's residual tail), taken fresh with its table and
       never keyed: :meth:`tail_of`.
    6. :meth:`release` drops the request's references: a block reaching zero goes to the cache (keyed) or the
       free list.

    With ``prefix_cache=False`` nothing is keyed: every block is taken fresh and freed on release.
    """

    def __init__(self, layout: KVLayout, budget_bytes: int, device: torch.device | str = "cpu",
                 allocate: bool = True, prefix_cache: bool = True, salt: str = ""):
        self.layout = layout
        self.num_blocks = budget_bytes // layout.bytes_per_block
        if self.num_blocks < 1:
            raise KVBudgetError(
                f"KV budget of {budget_bytes} bytes holds no block of {layout.block_size} tokens "
                f"({layout.bytes_per_block} bytes)"
            )
        # (layers, 2, blocks, block_size, kv_heads, head_dim): one contiguous allocation, made once; with a KV
        # format, the codes, and beside them ``scales`` (layers, 2, blocks, block_size, kv_heads) float16.
        # int4: (layers, blocks, unit bytes) uint8, each block an int4 block or a tail half (server/kv_int4.py).
        shape = (layout.layers, 2, self.num_blocks, layout.block_size, layout.kv_heads)
        if not allocate:
            self.storage = None
        elif layout.int4:
            self.storage = kv_int4.allocate(layout.layers, self.num_blocks, layout.block_size, layout.kv_heads,
                                            layout.head_dim, device)
        else:
            self.storage = torch.zeros(*shape, layout.head_dim, dtype=layout.storage_dtype, device=device)
        self.scales = (torch.zeros(*shape, dtype=torch.float16, device=device)
                       if allocate and layout.kv_format and not layout.int4 else None)
        self.prefix_cache = prefix_cache
        # What else decides a block's K/V besides its tokens: the pool's layout, and what the engine adds.
        self._root = hashlib.blake2b(f"{layout}|{salt}".encode(), digest_size=16).digest()
        self._free = list(range(self.num_blocks - 1, -1, -1))  # a stack: reuse the warmest blocks first
        self._refs = [0] * self.num_blocks
        self._holders: list[set[str]] = [set() for _ in range(self.num_blocks)]
        self._key_of: dict[int, bytes] = {}  # cached or published block -> its key
        self._block_of: dict[bytes, int] = {}  # key -> block
        self._cached: OrderedDict[int, None] = OrderedDict()  # keyed blocks no request holds, oldest first
        self._owned: dict[str, list[int]] = {}  # request -> its block table
        self._tails: dict[str, list[int]] = {}  # request -> its tail's blocks (layout.tail_blocks of them)
        self._keys: dict[str, list[bytes]] = {}  # request -> the keys of its prompt's full blocks
        self._published: dict[str, int] = {}  # request -> blocks of its table keyed so far (hits included)
        self._hits: dict[str, int] = {}  # request -> blocks mapped from the cache at reservation
        self._shared: dict[str, set[int]] = {}  # request -> its blocks another holder had or took while it held them
        self.hit_tokens = 0  # prompt tokens mapped from the cache, over every admitted request
        self.queried_tokens = 0  # prompt tokens of every admitted request
        self.evictions = 0  # cached blocks given to another request's fresh blocks

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.layout.block_size

    @property
    def capacity_bytes(self) -> int:
        return self.num_blocks * self.layout.bytes_per_block

    @property
    def free_blocks(self) -> int:
        """Blocks a reservation can take now: free, or cached and held by no request."""
        return len(self._free) + len(self._cached)

    @property
    def used_blocks(self) -> int:
        """Blocks held by at least one request, each counted once however many hold it."""
        return self.num_blocks - self.free_blocks

    @property
    def cached_blocks(self) -> int:
        """Keyed blocks no request holds: kept for later hits, evicted when their space is needed."""
        return len(self._cached)

    def can_ever_fit(self, tokens: int) -> bool:
        return self.layout.sample_blocks(tokens) <= self.num_blocks

    def _chain(self, prompt: list[int]) -> list[bytes]:
        """The keys of the prompt's full blocks (step 1)."""
        bs, parent, keys = self.layout.block_size, self._root, []
        for i in range(len(prompt) // bs):
            parent = hashlib.blake2b(parent + array("q", prompt[i * bs:(i + 1) * bs]).tobytes(),
                                     digest_size=16).digest()
            keys.append(parent)
        return keys

    def cached_prefix(self, prompt: list[int]) -> int:
        """Blocks of ``prompt`` a reservation would map from the cache now (step 3), without taking them."""
        return len(self._lookup(prompt)[1])

    def _lookup(self, prompt: list[int] | None) -> tuple[list[bytes], list[int], int]:
        """(the keys of the prompt's full blocks, the cached blocks a reservation maps, how many of those no request
        holds: cached blocks that must not be evicted for the reservation mapping them)."""
        keys = self._chain(prompt) if prompt and self.prefix_cache else []
        hits = []
        for key in keys[:shared_blocks(len(prompt or ()), self.layout.block_size)]:  # before the last token's block
            b = self._block_of.get(key)
            if b is None:
                break
            hits.append(b)
        return keys, hits, sum(1 for b in hits if self._refs[b] == 0)

    def _room(self, fresh: int, idle_hits: int, headroom: int = 0) -> bool:
        return fresh + headroom <= len(self._free) + len(self._cached) - idle_hits

    def _reserve(self, request_id: str, mapped: list[int], fresh: int, keys: list[bytes], hits: int) -> list[int]:
        """Record a reservation the caller checked there is room for: ``mapped`` blocks (another holder's or cached:
        shared from now on, by it and by every holder) then ``fresh`` ones; ``hits`` of them came from the cache."""
        self._shared[request_id] = set(mapped)
        for b in mapped:
            if self._refs[b] == 0:
                del self._cached[b]
            for other in self._holders[b]:  # they share it from now on too
                self._shared[other].add(b)
            self._take(b, request_id)
        table = mapped + [self._take(self._fresh(), request_id) for _ in range(fresh)]
        self._owned[request_id] = table
        self._tails[request_id] = [self._take(self._fresh(), request_id) for _ in range(self.layout.tail_blocks)]
        self._keys[request_id] = keys
        self._published[request_id] = len(mapped)  # mapped blocks are keyed already, or the first sample keys them
        self._hits[request_id] = hits
        return table

    def try_reserve(self, request_id: str, tokens: int, prompt: list[int] | None = None,
                    use_cache: bool = True, headroom: int = 0, tally: bool = True) -> list[int] | None:
        """Reserve the blocks of ``tokens`` positions, or nothing (None) if they are not free now with ``headroom``
        blocks to spare. With ``prompt``, its cached full blocks come first in the table, mapped, not taken
        (:meth:`hit_blocks` says how many), unless ``use_cache`` is False (a request that scores its whole prompt
        computes every block; it still publishes). ``tally``: count the prompt in the hit rate's figures (not for a
        preempted request taken back, whose prompt was counted when it was first admitted)."""
        if request_id in self._owned:
            raise ValueError(f"request {request_id} already holds KV blocks")
        keys, hits, idle_hits = self._lookup(prompt)
        if not use_cache:
            hits, idle_hits = [], 0
        fresh = self.layout.blocks_for(tokens) - len(hits)
        if not self._room(fresh + self.layout.tail_blocks, idle_hits, headroom):
            return None
        if prompt and tally:
            self.queried_tokens += len(prompt)
            self.hit_tokens += len(hits) * self.layout.block_size
        return self._reserve(request_id, hits, fresh, keys, len(hits))

    def group_blocks(self, prompt_tokens: int, tokens: int, n: int) -> int:
        """Blocks a group of ``n`` samples of one prompt reserves with nothing cached (:meth:`try_reserve_group`)."""
        return group_blocks(prompt_tokens, tokens, n, self.layout.block_size, self.layout.tail_blocks)

    def try_reserve_group(self, request_ids: list[str], tokens: int, prompt: list[int],
                          use_cache: bool = True, headroom: int = 0) -> list[list[int]] | None:
        """Reserve ``n = len(request_ids)`` samples of one prompt at once, or nothing (None): the first is reserved as
        :meth:`try_reserve` does (its cached prefix mapped); each other maps the first's blocks of the prompt's full
        blocks before its last token's block (:func:`shared_blocks`: the first prefills them, the others wait for
        that) and takes fresh blocks for the rest. Their tables, in order."""
        leader, *others = request_ids
        for rid in others:
            if rid in self._owned:
                raise ValueError(f"request {rid} already holds KV blocks")
        total = self.layout.blocks_for(tokens)
        k = shared_blocks(len(prompt), self.layout.block_size)
        _, hits, idle_hits = self._lookup(prompt) if use_cache else ([], [], 0)
        tails = (1 + len(others)) * self.layout.tail_blocks
        if not self._room((total - len(hits)) + len(others) * (total - k) + tails, idle_hits, headroom):
            return None
        first = self.try_reserve(leader, tokens, prompt, use_cache)
        # (the others' prompt blocks come from the first sample, not the cache: no hit counted)
        return [first] + [self._reserve(rid, first[:k], total - k, self._keys[leader], 0) for rid in others]

    def _take(self, b: int, request_id: str) -> int:
        self._refs[b] += 1
        self._holders[b].add(request_id)
        return b

    def _fresh(self) -> int:
        """A block to write: a free one, else the least recently released cached one, evicted (its key dropped)."""
        if self._free:
            return self._free.pop()
        b, _ = self._cached.popitem(last=False)
        del self._block_of[self._key_of.pop(b)]
        self.evictions += 1
        return b

    def publish(self, request_id: str, tokens: int) -> int:
        """Key the request's full prompt blocks among its first ``tokens`` positions (written by its prefill) so
        later reservations map them (step 4); returns how many were keyed now."""
        keys = self._keys.get(request_id)
        if not keys:
            return 0
        table, done = self._owned[request_id], self._published[request_id]
        upto = min(tokens // self.layout.block_size, len(keys))
        keyed = 0
        for i in range(done, upto):
            b = table[i]
            if keys[i] not in self._block_of and b not in self._key_of:
                self._block_of[keys[i]] = b
                self._key_of[b] = keys[i]
                keyed += 1
        self._published[request_id] = max(done, upto)
        return keyed

    def grow(self, request_id: str, tokens: int) -> bool:
        """Extend the request's table to hold ``tokens`` positions with fresh blocks (free first, then evicted
        cached ones); False, taking nothing, when not enough are free (step 5)."""
        table = self._owned[request_id]
        need = self.layout.blocks_for(tokens) - len(table)
        if need <= 0:
            return True
        if not self._room(need, 0):
            return False
        table.extend(self._take(self._fresh(), request_id) for _ in range(need))
        return True

    def shrink(self, request_id: str, tokens: int) -> int:
        """Give back the blocks of the request's table past those holding ``tokens`` positions (a speculative
        step's rejected drafts); returns how many. Only blocks no one else maps and the cache does not key may go:
        anything else is a caller's bug, refused (ValueError) with nothing changed."""
        table = self._owned[request_id]
        keep = self.layout.blocks_for(tokens)
        extra = table[keep:]
        for b in extra:
            if self._refs[b] != 1 or b in self._key_of:
                raise ValueError(f"request {request_id}: block {b} past its {tokens} positions is shared or cached")
        del table[keep:]
        for b in reversed(extra):
            self._refs[b] -= 1
            self._holders[b].discard(request_id)
            self._free.append(b)
        return len(extra)

    def hit_blocks(self, request_id: str) -> int:
        """Blocks the request mapped from the cache when it reserved: its first hit_blocks x block_size prompt
        tokens need no prefill."""
        return self._hits.get(request_id, 0)

    def shared_blocks(self, request_id: str) -> int:
        """Blocks of the request's table that the cache or another live request also held while it held them."""
        return len(self._shared.get(request_id, ()))

    def release(self, request_id: str) -> int:
        """Drop a request's references at once; returns how many blocks it held. Releasing twice is harmless."""
        blocks = self._owned.pop(request_id, []) + self._tails.pop(request_id, [])
        for d in (self._keys, self._published, self._hits, self._shared):
            d.pop(request_id, None)
        # the deepest block first: cached, it is evicted before its parents (tail blocks are never keyed: freed)
        for b in reversed(blocks):
            self._refs[b] -= 1
            self._holders[b].discard(request_id)
            if self._refs[b] == 0:
                if b in self._key_of:
                    self._cached[b] = None
                else:
                    self._free.append(b)
        return len(blocks)

    def blocks_of(self, request_id: str) -> list[int]:
        return self._owned[request_id]

    def tail_of(self, request_id: str) -> list[int]:
        """The request's tail blocks (int4: its K half, its V half); empty for other dtypes."""
        return self._tails[request_id]

    def held_blocks(self, request_id: str) -> int:
        """Blocks the request holds: its table and its tail."""
        return len(self._owned[request_id]) + len(self._tails[request_id])

    def audit(self) -> None:
        """The pool's own bookkeeping against a recount of its blocks: ValueError naming the first difference (a
        leaked reference, a freed block still mapped, a held block in the cache)."""
        refs = [0] * self.num_blocks
        if self._tails.keys() != self._owned.keys():
            raise ValueError("a request holds a table without a tail, or a tail without a table")
        for rid, table in self._owned.items():
            if len(self._tails[rid]) != self.layout.tail_blocks:
                raise ValueError(f"{rid} holds {len(self._tails[rid])} tail blocks, not {self.layout.tail_blocks}")
            for b in table + self._tails[rid]:
                refs[b] += 1
                if rid not in self._holders[b]:
                    raise ValueError(f"block {b} is in {rid}'s table but not held by it")
        if refs != self._refs:
            b = next(i for i, (a, c) in enumerate(zip(refs, self._refs)) if a != c)
            raise ValueError(f"block {b}: {self._refs[b]} references counted, {refs[b]} in the tables")
        free, cached = set(self._free), set(self._cached)
        if len(free) != len(self._free) or free & cached:
            raise ValueError("a block is free twice, or both free and cached")
        for b in range(self.num_blocks):
            held = refs[b] > 0
            if held + (b in free) + (b in cached) != 1:
                raise ValueError(f"block {b} is {'held' if held else 'not held'}, "
                                 f"{'free' if b in free else 'not free'}, {'cached' if b in cached else 'not cached'}")
            if len(self._holders[b]) != refs[b]:
                raise ValueError(f"block {b}: {refs[b]} references, {len(self._holders[b])} holders")
            if b in free and b in self._key_of:
                raise ValueError(f"free block {b} is still keyed")
            if b in cached and b not in self._key_of:
                raise ValueError(f"cached block {b} has no key")
        if any(self._block_of.get(k) != b for b, k in self._key_of.items()) or len(self._block_of) != len(self._key_of):
            raise ValueError("the key -> block and block -> key maps disagree")
        if any(b in self._key_of for tail in self._tails.values() for b in tail):
            raise ValueError("a tail block is keyed")

    def stats(self) -> dict:
        return {
            "block_size": self.layout.block_size,
            "bytes_per_token": self.layout.bytes_per_token,
            "capacity_blocks": self.num_blocks,
            "capacity_bytes": self.capacity_bytes,
            "used_blocks": self.used_blocks,
            "used_bytes": self.used_blocks * self.layout.bytes_per_block,
            "cached_blocks": self.cached_blocks,
            "requests": len(self._owned),
            "prefix_hit_tokens": self.hit_tokens,
            "prefix_queried_tokens": self.queried_tokens,
            "prefix_evictions": self.evictions,
        }
