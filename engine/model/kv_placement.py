"""Where each layer of a model keeps its K and V (or its recurrent state), from its layer kinds: the pool's layers,
the layers a sliding window sets apart, the shapes they keep."""
from __future__ import annotations


class KVPlacement:
    """ModelConfig's answers about its layers' K and V (it has `layer_kinds`, `num_layers`, `head_dim`,
    `num_kv_heads`)."""

    __slots__ = ()

    @property
    def num_recurrent_layers(self) -> int:
        return sum(kind.recurrent for kind in self.layer_kinds)

    def keeps_kv(self, layer_index: int) -> bool:
        """Whether the layer keeps K and V of its own (a recurrent one keeps a state, a Gemma 4 one may reuse)."""
        kind = self.layer_kinds[layer_index]
        return not kind.recurrent and not kind.reuses_kv

    @property
    def num_kv_layers(self) -> int:
        """Layers that keep K and V in the pool."""
        return sum(map(self.keeps_kv, range(self.num_layers)))

    def kv_source(self, layer_index: int) -> int:
        """The layer whose K and V layer `layer_index` reads: itself, or where it reuses another's, the last
        earlier layer of its window that keeps its own."""
        window = self.layer_kinds[layer_index].window
        if not self.layer_kinds[layer_index].reuses_kv:
            return layer_index
        return max(i for i in range(layer_index) if self.keeps_kv(i) and self.layer_kinds[i].window == window)

    def kv_layer(self, layer_index: int) -> int:
        """Where layer `layer_index` finds its K and V among the pool's layers."""
        return sum(map(self.keeps_kv, range(self.kv_source(layer_index))))

    def state_layer(self, layer_index: int) -> int:
        """Where recurrent layer `layer_index` keeps its state among a state slot's layers."""
        return sum(kind.recurrent for kind in self.layer_kinds[:layer_index])

    def layer_head_dim(self, layer_index: int) -> int:
        return self.layer_kinds[layer_index].head_dim or self.head_dim

    def layer_kv_heads(self, layer_index: int) -> int:
        return self.layer_kinds[layer_index].kv_heads or self.num_kv_heads

    def kv_shape(self, sliding: bool) -> tuple[int, int]:
        """(KV heads, head size) of the layers keeping K and V that slide (`sliding`) or attend to every token;
        the model's where it has none of them."""
        layers = [i for i in range(self.num_layers)
                  if self.keeps_kv(i) and bool(self.layer_kinds[i].window) == sliding]
        return (self.layer_kv_heads(layers[0]), self.layer_head_dim(layers[0])) if layers else \
            (self.num_kv_heads, self.head_dim)

    @property
    def mixed_kv_shapes(self) -> bool:
        """Whether its layers keep K and V of different shapes (Gemma 4): only window slots can hold them."""
        return len({(self.layer_kv_heads(i), self.layer_head_dim(i))
                    for i in range(self.num_layers) if self.keeps_kv(i)}) > 1

    def kv_elements_per_token(self) -> int:
        """K and V of every layer keeping them, for one token."""
        return sum(2 * self.layer_kv_heads(i) * self.layer_head_dim(i)
                   for i in range(self.num_layers) if self.keeps_kv(i))

    @property
    def windows(self) -> tuple[int, ...]:
        """Each layer's sliding window (0: the layer attends to every earlier token)."""
        return tuple(kind.window for kind in self.layer_kinds)

    @property
    def kv_window(self) -> int:
        """The window every attention layer slides with, when they share one (0: some layer reads every token):
        a sequence's KV blocks behind it are never read again."""
        windows = {kind.window for kind in self.layer_kinds if not kind.recurrent}
        return windows.pop() if len(windows) == 1 else 0

    @property
    def split_window(self) -> int:
        """The one window of the sliding layers of a model that also has full-attention layers (0: the model has
        no such mix): their K and V can live apart from the full layers' (`WindowSlots`), for the window only."""
        windows = {self.layer_kinds[i].window for i in range(self.num_layers) if self.keeps_kv(i)}
        if len(windows) != 2 or 0 not in windows or self.num_recurrent_layers:
            return 0
        return max(windows)

    def pool_layer(self, layer_index: int, split: bool) -> int:
        """Where attention layer `layer_index` keeps its K and V: among the pool's layers, or with `split` (a
        `split_window` model whose sliding layers keep theirs apart) among its own kind's layers."""
        if not split:
            return self.kv_layer(layer_index)
        source = self.kv_source(layer_index)
        window = self.layer_kinds[source].window
        return sum(self.keeps_kv(i) and self.layer_kinds[i].window == window for i in range(source))

    @property
    def num_full_layers(self) -> int:
        """Full-attention layers keeping K and V."""
        return sum(self.keeps_kv(i) and not self.layer_kinds[i].window for i in range(self.num_layers))
