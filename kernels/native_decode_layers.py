"""Every decoder layer of a decode step in one native call (kernels/csrc/decode_layers.cpp).

The per-op path calls ten kernels a layer from Python (RMSNorm, QKV, rotary + KV store, attention,
O, RMSNorm, gate-up, SiLU-and-mul, down), and at one row each call's Python (checks, allocation,
ctypes) costs about what its kernel does. This runs the same kernels in the same order from C++:
the same numbers, one call a step. It serves Llama-style layers without q/k norms, float32 or
bfloat16, whose projections are dense, quantized (quant_linear.c's blocks) or GGUF blocks, at decode batches
where the per-op path would run a native kernel for every projection (the quantized kernel up to its
`max_rows`, the native linear over the dense weight above them and for dense projections, where it
beats BLAS: `pdserve.kernels.native_linear.prefer_native`); everything else keeps the per-op path.
Each row count's choice is one pointer table: blocks or dense weight per projection.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from pdserve.kernels.native import FLOAT, INT, INT64, POINTER, SUFFIXES, bind, int64_array
from pdserve.kernels.native_decode_attention import MAX_GROUP, MAX_HEAD_DIM, num_splits, table_runs
from pdserve.kernels.gguf_formats import GGUFMatrix
from pdserve.kernels.gguf_linear import native_available as gguf_available
from pdserve.kernels.gguf_linear import supports as gguf_supports
from pdserve.kernels.native_linear import MAX_NATIVE_ROWS, prefer_native, row_bucket
from pdserve.kernels.quant_formats import FORMATS
from pdserve.kernels.quant_linear import KernelWeight, quant_linear_address
from pdserve.kernels.quant_linear import native_available as quant_available
from pdserve.kernels.quant_linear import supports as quant_supports

NATIVE_DTYPES = (torch.float32, torch.bfloat16)
WORDS_PER_PROJECTION = 6   # Projection.words(); LayerWeights and Projection in decode_layers.cpp
WORDS_PER_LAYER = 2 + 4 * WORDS_PER_PROJECTION   # two norms, then qkv, o, gate-up, down
GGUF_FORMAT = 100          # NOTE: GGUF_FORMAT in decode_layers.cpp


@dataclass(frozen=True, slots=True)
class Projection:
    """One linear of a layer: its dense weight and bias, and, when quantized, its kernel blocks, which
    serve batches up to `max_rows` (the per-op QuantizedLinear's rule). GGUF blocks have no dense weight:
    the one-call step always computes from them."""

    weight: torch.Tensor | None
    bias: torch.Tensor | None = None
    packed: KernelWeight | GGUFMatrix | None = None
    max_rows: int = 0

    @property
    def in_features(self) -> int:
        return self.packed.shape[1] if self.weight is None else self.weight.shape[1]

    def blocks_serve(self, rows: int) -> bool:
        """Whether a step of `rows` rows reads this projection's blocks (else its dense weight)."""
        return self.packed is not None and rows <= self.max_rows

    def words(self, blocks: bool) -> list[int]:
        """format (0 dense, else quant_linear's + 1), weight or blocks, bias, block scales, mins, channel scales;
        the dense weight's words unless `blocks`."""
        bias = _address(self.bias)
        p = self.packed
        if isinstance(p, GGUFMatrix):
            return [GGUF_FORMAT, p.table.data_ptr(), bias, len(p.segments), 0, 0]
        if p is None or not blocks:
            return [0, self.weight.data_ptr(), bias, 0, 0, 0]
        block_scales, channel_scales = (0, p.scales.data_ptr()) if p.format == "int8" else (p.scales.data_ptr(), 0)
        return [FORMATS.index(p.format) + 1, p.qs.data_ptr(), bias, block_scales, _address(p.mins), channel_scales]


@dataclass(frozen=True, slots=True)
class LayerTensors:
    """One decoder layer's parameters."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Projection
    o: Projection
    gate_up: Projection
    down: Projection

    @property
    def projections(self) -> tuple[Projection, ...]:
        return self.qkv, self.o, self.gate_up, self.down

    def words(self, blocks: tuple[bool, ...]) -> list[int]:
        """The layer's table words, each projection's blocks where `blocks` (qkv, o, gate-up, down) says."""
        return [self.input_norm.data_ptr(), self.post_norm.data_ptr(),
                *(word for p, b in zip(self.projections, blocks) for word in p.words(b))]


def _address(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


@dataclass(frozen=True, slots=True, eq=False)
class DecodeLayers:
    """A model's decoder layers as the native step takes them (a pointer table per choice of blocks or dense
    weights, built once)."""

    layers: tuple[LayerTensors, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    scale: float
    window: int            # every layer's sliding window (0: none)
    quant_linear: int | None   # quant_linear.c's entry point, where a projection is int8 (built only then)
    _native_wins: dict[tuple[int, int], bool] = field(default_factory=dict)   # (rows, threads) ->
    _timed: dict[tuple[int, int], bool] = field(default_factory=dict)         # (row bucket, threads) ->
    _tables: dict[tuple[tuple[bool, ...], ...], torch.Tensor] = field(default_factory=dict)   # per layer and
    #                                                         projection, whether it reads its blocks -> table
    _by_rows: dict[int, torch.Tensor] = field(default_factory=dict)          # rows -> its table (a step's lookup)

    @classmethod
    def build(cls, layers: list[LayerTensors], num_heads: int, num_kv_heads: int, head_dim: int,
              eps: float, window: int = 0) -> DecodeLayers | None:
        """None when the native step cannot serve these layers (dtype, layout, head shape)."""
        if not layers or not _supported(layers, num_heads, num_kv_heads, head_dim):
            return None
        return cls(tuple(layers), num_heads, num_kv_heads, head_dim, eps, head_dim ** -0.5, window,
                   quant_linear_address() if _int8(layers) else None)

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].input_norm.dtype

    @property
    def hidden(self) -> int:
        return self.layers[0].input_norm.shape[0]

    @property
    def inner(self) -> int:
        return self.layers[0].down.in_features

    def serves(self, rows: int) -> bool:
        """Whether a decode step of `rows` sequences goes native: as timed at load for its row bucket
        (`decide`), else where the per-op path would run a native kernel for every projection (decided once
        per row count and thread count)."""
        if not 0 < rows <= MAX_NATIVE_ROWS:
            return False
        timed = self._timed.get((row_bucket(rows), torch.get_num_threads()))
        if timed is not None:
            return timed
        key = (rows, torch.get_num_threads())
        wins = self._native_wins.get(key)
        if wins is None:
            wins = self._native_wins[key] = all(p.blocks_serve(rows) or _native_linear_takes(p, rows)
                                                for layer in self.layers for p in layer.projections)
        return wins

    def decide(self, bucket: int, threads: int, one_call: bool) -> None:
        """Steps of `bucket`'s rows (`row_bucket`) at `threads` go native or not, as a whole step measured
        (the per-op path's Python per op can outweigh a faster BLAS kernel: engine.worker.startup.warmup)."""
        self._timed[(bucket, threads)] = one_call

    def table(self, rows: int) -> torch.Tensor:
        """The pointer table (int64 [layers * WORDS_PER_LAYER]) a step of `rows` rows runs: each quantized
        projection's blocks up to its `max_rows`, its dense weight above them."""
        table = self._by_rows.get(rows)
        if table is None:
            blocks = tuple(tuple(p.blocks_serve(rows) for p in layer.projections) for layer in self.layers)
            if blocks not in self._tables:
                self._tables[blocks] = torch.tensor(
                    [w for layer, own in zip(self.layers, blocks) for w in layer.words(own)], dtype=torch.int64)
            table = self._by_rows[rows] = self._tables[blocks]
        return table


def _native_linear_takes(projection: Projection, rows: int) -> bool:
    w = projection.weight
    return w is not None and prefer_native(torch.zeros(rows, w.shape[1], dtype=w.dtype), w)


def _int8(layers: list[LayerTensors]) -> list[KernelWeight]:
    """The projections quant_linear.c computes (int8-packed weights)."""
    return [p.packed for layer in layers for p in layer.projections if isinstance(p.packed, KernelWeight)]


def _supported(layers: list[LayerTensors], num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    norms = [t for layer in layers for t in (layer.input_norm, layer.post_norm)]
    return (_runs_native(norms, [p for layer in layers for p in layer.projections], layers[0].input_norm.dtype)
            and head_dim % 16 == 0 and head_dim <= MAX_HEAD_DIM and num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads <= MAX_GROUP)


def _runs_native(norms: list[torch.Tensor], projections: list[Projection], dtype: torch.dtype) -> bool:
    """Whether the native step takes these norms and projections in `dtype`: dense tensors contiguous on the CPU
    in it, int8 blocks of a format quant_linear.c has, GGUF blocks on the CPU of types gguf_linear.cpp has."""
    dense = [t for t in (*norms, *(x for p in projections for x in (p.weight, p.bias))) if t is not None]
    packed = [p.packed for p in projections if isinstance(p.packed, KernelWeight)]
    blocks = [p.packed for p in projections if isinstance(p.packed, GGUFMatrix)]
    return (dtype in NATIVE_DTYPES and all(t.dtype == dtype and t.is_contiguous() and t.is_cpu for t in dense)
            and all(quant_supports(p.format, p.shape[1], dtype) for p in packed)
            and (not packed or quant_available())
            and all(gguf_supports(m, dtype) and m.segments[0].data.is_cpu for m in blocks)
            and (not blocks or gguf_available()))


@dataclass(frozen=True, slots=True, eq=False)
class Head:
    """The model's final norm and its head, which the one-call step can run after the last layer: the
    step's logits then come back from the same call (the Python of two more kernel calls, each paying for
    caches the weights' stream has just emptied, is a one-row step's largest host cost after the layers)."""

    norm: torch.Tensor
    projection: Projection
    _words: dict[bool, torch.Tensor] = field(default_factory=dict)
    _serves: dict[tuple[int, int], bool] = field(default_factory=dict)     # (rows, threads) ->

    @classmethod
    def build(cls, norm: torch.Tensor, projection: Projection, layers: DecodeLayers) -> Head | None:
        """None where the native step over `layers` cannot run this head (the per-op path keeps it)."""
        no_entry = isinstance(projection.packed, KernelWeight) and layers.quant_linear is None   # NOTE: int8's
        served = _runs_native([norm], [projection], layers.dtype) and not no_entry    # entry comes with the layers
        return cls(norm, projection) if served else None

    @property
    def rows(self) -> int:
        p = self.projection
        return p.packed.shape[0] if p.weight is None else p.weight.shape[0]

    def serves(self, rows: int) -> bool:
        """Whether the head of a step of `rows` rows runs the kernel the per-op path would (the same logits)."""
        key = (rows, torch.get_num_threads())
        served = self._serves.get(key)
        if served is None:
            p = self.projection
            served = self._serves[key] = p.blocks_serve(rows) or _native_linear_takes(p, rows)
        return served

    def words(self, rows: int) -> torch.Tensor:
        blocks = self.projection.blocks_serve(rows)
        if blocks not in self._words:
            self._words[blocks] = torch.tensor(self.projection.words(blocks), dtype=torch.int64)
        return self._words[blocks]


@functools.cache
def _kernel(dtype: torch.dtype):
    function = bind(f"pd_decode_layers_{SUFFIXES[str(dtype)]}", *[POINTER] * 12, FLOAT, FLOAT, POINTER, INT,
                    POINTER, POINTER, INT64, POINTER, POINTER)
    function.restype = INT
    return function


def decode_layers_native(layers: DecodeLayers, h: torch.Tensor, kv_pool: torch.Tensor, positions: torch.Tensor,
                         slot_mapping: torch.Tensor, cos_sin: torch.Tensor, block_tables: torch.Tensor,
                         context_lens: torch.Tensor, head: Head | None = None):
    """Run every layer over h [S, hidden] (the embeddings of one token per sequence); returns the
    last layer's output and the residual sum, as the per-op loop leaves them for the final norm, or with
    `head` (which must serve S rows) the logits [S, head rows] float32 of the final norm and the head."""
    seqs, hidden = h.shape
    _, num_layers, _, block_size, num_kv_heads, head_dim = kv_pool.shape
    _check(layers, h, kv_pool, positions, slot_mapping, cos_sin, block_tables, context_lens)
    threads = torch.get_num_threads()
    context = block_tables.shape[1] * block_size
    splits = num_splits(table_runs(block_tables), min(layers.window, context) if layers.window else context, threads)
    q_size, kv_size = layers.num_heads * head_dim, num_kv_heads * head_dim
    width = hidden + (q_size + 2 * kv_size) + 2 * q_size + 3 * layers.inner
    scratch = torch.empty(seqs * width, dtype=h.dtype)
    partials = torch.empty(seqs * layers.num_heads * splits * (head_dim + 1)) if splits > 1 else None
    out, residual = h.clone(), torch.empty_like(h)
    block, layer, kv, slot, head_stride = kv_pool.stride()[:5]
    shape = int64_array(seqs, hidden, layers.num_heads, num_kv_heads, head_dim, layers.inner, num_layers, splits,
                        block_size, block, layer, kv, slot, head_stride, block_tables.stride(0), cos_sin.stride(0), 0,
                        layers.window)
    final = (None, None, 0, None, None)
    if head is not None:
        head_out, logits = torch.empty(seqs, head.rows, dtype=h.dtype), torch.empty(seqs, head.rows)
        final = (head.norm.data_ptr(), head.words(seqs).data_ptr(), head.rows, head_out.data_ptr(), logits.data_ptr())
    status = _kernel(h.dtype)(out.data_ptr(), residual.data_ptr(), layers.table(seqs).data_ptr(), shape,
                              kv_pool.data_ptr(), positions.data_ptr(), slot_mapping.data_ptr(), cos_sin.data_ptr(),
                              block_tables.data_ptr(), context_lens.data_ptr(), scratch.data_ptr(),
                              None if partials is None else partials.data_ptr(), layers.eps, layers.scale,
                              layers.quant_linear, threads, *final)
    if status != 0:
        raise RuntimeError("decode_layers: quant_linear refused a projection it was checked for")
    return (out, residual) if head is None else logits


def _check(layers: DecodeLayers, h: torch.Tensor, kv_pool: torch.Tensor, positions: torch.Tensor,
           slot_mapping: torch.Tensor, cos_sin: torch.Tensor, block_tables: torch.Tensor,
           context_lens: torch.Tensor) -> None:
    seqs = h.shape[0]
    assert h.dtype == kv_pool.dtype == layers.dtype and h.is_contiguous() and h.shape[1] == layers.hidden
    assert kv_pool.is_contiguous() and kv_pool.shape[1] == len(layers.layers) and kv_pool.shape[5] == layers.head_dim
    assert kv_pool.shape[4] == layers.num_kv_heads
    assert positions.shape == slot_mapping.shape == context_lens.shape == (seqs,) and block_tables.shape[0] == seqs
    assert all(t.dtype == torch.int32 and t.is_contiguous() for t in (positions, slot_mapping, context_lens))
    assert block_tables.dtype == torch.int32 and block_tables.stride(1) == 1
    assert cos_sin.dtype == torch.float32 and cos_sin.shape[1] == layers.head_dim and cos_sin.stride(1) == 1
