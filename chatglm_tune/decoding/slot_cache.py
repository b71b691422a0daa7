"""The serving engine's running batch in fixed buffers, for compiled decode steps (`ServingOptions.compiled`).

A request keeps one slot of the buffers from joining to leaving, so a step's tensors stay where a compiled step's
CUDA graphs recorded them, where `batch_cache.BatchCache` makes new tensors whenever rows join or leave.

Layout: each layer's keys / values [slots, heads, P + C, D] (made at the first join): the P-tuning prefix, then C
columns. Every live row's tokens end at one column `column`, the next one a step writes (transformers'
`StaticCache` writes one column for the whole batch): a joining row's prompt goes into the columns before it (its
left pads masked), then each step writes every row's entry there. `mask` [slots, C] says which columns hold a row's
tokens; `positions` counts each row's own tokens (the position of its next one). A row leaving frees its slot and
copies nothing; a newcomer takes the lowest free slot, so the live slots stay packed at the front. A step runs the
first `rows` slots, every slot up to the last live one (free ones among them compute masked garbage that nobody
reads), and the first columns up to `column`, both rounded up to buckets where the step is compiled: powers of two
rows, multiples of `COLUMN_STEP` columns; each pair of buckets is one recorded graph.
When `column` reaches C, the columns no live row uses any more (left by rows that left) are cut, the live part
shifted left; where none can be cut the buffers grow by a quarter (new tensors: the graphs are recorded again). A
prompt longer than `column` shifts the live part right to make room before it.
Positions and masks are each row's own, as in `BatchCache`, so a row's tokens are the ones `generate` gives its
prompt alone, up to the float rounding of batched products. ChatGLM-6B, whose rows carry two positions and whose
prompts attend both ways, is not served this way (`unsupported`).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import StaticCache

from chatglm_tune.decoding import static_decoding
from chatglm_tune.decoding.batch_cache import BatchCache, prefix_length

COLUMN_STEP = 256  # the columns a step reads come in multiples of this (and the buffers grow by it at the least)
# Columns past the capacity that no step reads: a step's view over a whole buffer would have strides equal to its
# mask's width times a constant, a relation torch.compile then guards on, compiling again at the next narrower view.
SPARE = 1


class SlotCache:
    """The running batch in fixed buffers (module docstring), its steps through `static_decoding.compiled_step` on
    bucketed shapes. `slots`: rows at most (the engine's max_batch)."""

    def __init__(self, model, slots: int):
        self.model, self.slots = model, slots
        self.prefix_len = prefix_length(model)
        self.rows: list[int] = []  # row i of the batch (the engine's order) lives in slot rows[i]
        self.column = 0  # the column every live row writes next
        self.keys: list[torch.Tensor] = []  # per layer [slots, heads, P + C, D]
        self.values: list[torch.Tensor] = []
        self.mask: torch.Tensor | None = None  # [slots, C] long: 1 where a slot's row has a token
        self.positions: torch.Tensor | None = None  # [slots] long: each row's next position
        self._lengths: list[torch.Tensor] = []  # per layer: the cache's write column (StaticLayer.cumulative_length)
        self._views: dict[tuple[int, int], StaticCache] = {}

    @property
    def capacity(self) -> int:
        return 0 if self.mask is None else self.mask.shape[1]

    def merge(self, other: BatchCache) -> None:
        """`other`'s rows (a prefilled `BatchCache`) after these, each in a free slot."""
        n, width = other.mask.shape
        taken = set(self.rows)
        free = [s for s in range(self.slots) if s not in taken][:n]
        if len(free) < n:
            raise ValueError(f"{n} rows join a batch of {len(self.rows)} with {self.slots} slots")
        if self.mask is None:
            self._allocate(other.cache.layers, _round_up(width + 1, COLUMN_STEP))
        if width > self.column:
            self._room_before(width)
        p, t = self.prefix_len, self.column
        index = torch.tensor(free, device=self.mask.device)
        for mine, theirs in zip(zip(self.keys, self.values), other.cache.layers, strict=True):
            for buffer, states in zip(mine, (theirs.keys, theirs.values)):
                buffer[index, :, :p] = states[:, :, :p]
                buffer[index, :, p + t - width : p + t] = states[:, :, p:]
        self.mask[index] = 0
        self.mask[index, t - width : t] = other.mask
        self.positions[index] = other.mask.sum(dim=1)
        self.rows = self.rows + free

    def select(self, index: torch.Tensor) -> None:
        """Only the rows at `index` (1D long, ascending) stay; the others' slots are free (nothing copied)."""
        kept = [self.rows[i] for i in index.tolist()]
        gone = sorted(set(self.rows) - set(kept))
        if gone:
            self.mask[torch.tensor(gone, device=self.mask.device)] = 0
        self.rows = kept
        if not kept:  # the next rows start at the first column
            self.column = 0

    def trim(self) -> None:
        """Cut the columns no live row uses where that leaves a step fewer column buckets to read."""
        lead = self._lead()
        if lead and _round_up(self.column - lead + 1, COLUMN_STEP) < _round_up(self.column + 1, COLUMN_STEP):
            self._move(-lead)

    def step(self, model, tokens: torch.Tensor) -> torch.Tensor:
        """One token a row in (`tokens` [rows], the engine's order), the scores of the next out [rows, V]."""
        if self.column == self.capacity:
            self._make_room()
        t, live = self.column, torch.tensor(self.rows, device=self.mask.device)
        rows = self._row_bucket(max(self.rows) + 1)
        columns = min(_round_up(t + 1, COLUMN_STEP), self.capacity)
        self.mask[:rows, t] = 1  # free slots too: a row of no key at all would give NaN
        ids = torch.zeros(rows, 1, dtype=torch.long, device=self.mask.device)
        ids[live, 0] = tokens
        for length in self._lengths:
            length.fill_(self.prefix_len + t)
        run = static_decoding.compiled_step(model, dynamic=True)
        # a new tensor of standard strides (`contiguous()` keeps a one-row view's): one stride pattern for every shape
        mask = self.mask[:rows, :columns].clone(memory_format=torch.contiguous_format)
        scores = run(ids, self.positions[:rows, None].clone(), mask, self._view(rows, columns))
        self.positions[live] += 1
        self.column += 1
        return scores[live]

    # ------------------------------------------------------------------------------------------
    # The buffers

    def _row_bucket(self, rows: int) -> int:
        return next(b for b in row_buckets(self.slots) if b >= rows)

    def _allocate(self, layers, columns: int) -> None:
        """Buffers of `columns` columns shaped after a prefilled cache's layers."""
        def empty(states: torch.Tensor) -> torch.Tensor:
            return states.new_zeros(self.slots, states.shape[1], self.prefix_len + columns + SPARE, states.shape[3])

        device = layers[0].keys.device
        self.keys, self.values = [empty(layer.keys) for layer in layers], [empty(layer.values) for layer in layers]
        self.mask = torch.zeros(self.slots, columns, dtype=torch.long, device=device)
        self.positions = torch.zeros(self.slots, dtype=torch.long, device=device)
        self._lengths = [torch.zeros((), dtype=torch.long, device=device) for _ in layers]
        self._views = {}

    def _lead(self) -> int:
        """Columns on the left that no live row uses."""
        if not self.rows:
            return self.column
        used = self.mask[torch.tensor(self.rows, device=self.mask.device), : self.column].any(dim=0)
        return int(used.long().argmax()) if bool(used.any()) else self.column

    def _make_room(self) -> None:
        """A free column at `column`: cut the columns no live row uses, else grow the buffers."""
        lead = self._lead()
        if lead:
            self._move(-lead)
        else:
            self._grow(self.capacity + 1)

    def _room_before(self, width: int) -> None:
        """At least `width` columns before `column` (the live part moved right, the buffers grown if need be)."""
        if width > self.capacity:
            self._grow(width)
        self._move(width - self.column)

    def _grow(self, columns: int) -> None:
        """New buffers of at least `columns` columns, and a quarter more than now (`COLUMN_STEP` at the least)."""
        grown = _round_up(max(columns, self.capacity + max(COLUMN_STEP, self.capacity // 4)), COLUMN_STEP)
        end = self.prefix_len + self.capacity

        def larger(old: torch.Tensor) -> torch.Tensor:
            new = old.new_zeros(*old.shape[:2], self.prefix_len + grown + SPARE, old.shape[3])
            new[:, :, :end] = old[:, :, :end]
            return new

        self.keys, self.values = [larger(k) for k in self.keys], [larger(v) for v in self.values]
        mask = self.mask.new_zeros(self.slots, grown)
        mask[:, : self.capacity] = self.mask
        self.mask, self._views = mask, {}

    def _move(self, n: int) -> None:
        """The used columns `n` to the right (n > 0; `column + n` must fit) or `-n` to the left (n < 0: over
        columns no live row uses)."""
        if n == 0:
            return
        p, t = self.prefix_len, self.column
        src, dst = (slice(0, t), slice(n, t + n)) if n > 0 else (slice(-n, t), slice(0, t + n))
        for buffer in (*self.keys, *self.values):
            buffer[:, :, p + dst.start : p + dst.stop] = buffer[:, :, p + src.start : p + src.stop].clone()
        self.mask[:, dst] = self.mask[:, src].clone()
        if n > 0:
            self.mask[:, :n] = 0
        else:
            self.mask[:, t + n : t] = 0
        self.column = t + n

    def _view(self, rows: int, columns: int) -> StaticCache:
        """A `StaticCache` over the buffers' first `rows` slots and `P + columns` columns (made once a shape; its
        tensors are marked as static addresses, as StaticCache marks its own)."""
        view = self._views.get((rows, columns))
        if view is None:
            end = self.prefix_len + columns
            view = StaticCache(config=self.model.config, max_cache_len=end)
            for layer, keys, values, length in zip(view.layers, self.keys, self.values, self._lengths, strict=True):
                layer.keys, layer.values = keys[:rows, :, :end], values[:rows, :, :end]
                layer.device, layer.batch_size, layer.num_heads = keys.device, rows, keys.shape[1]
                layer.k_head_dim, layer.v_head_dim = keys.shape[3], values.shape[3]
                layer.cumulative_length, layer.is_initialized = length, True
                for tensor in (layer.keys, layer.values, length):
                    torch._dynamo.mark_static_address(tensor)
            self._views[(rows, columns)] = view
        return view


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def unsupported(model) -> str | None:
    """Why compiled serving cannot hold `model`, or None: `static_decoding.unsupported`'s reasons, and ChatGLM-6B's
    two positions a row (the slots keep one)."""
    if hasattr(model, "next_positions"):
        return f"{type(model).__name__} carries two positions a row (ChatGLM-6B), the slots one: it is served eagerly"
    return static_decoding.unsupported(model)


def row_buckets(slots: int) -> list[int]:
    """The row counts a compiled step runs at for a batch of at most `slots` rows: powers of two, then `slots`."""
    return sorted({min(slots, 1 << k) for k in range(slots.bit_length() + 1)})
