"""A model as the planner sees it (guide §2.4, §7.2, §7.3, §9.4): its parameter count Ψ, the count
active per token (MoE: k of E routed experts, plus shared experts), and when known its transformer
shape — layers, hidden size, heads, key/value heads (grouped-query attention), FFN width,
vocabulary, experts. Where the models come from (presets, a ``config.json``, a shape typed by
hand) is :mod:`zerodp.plan.models`; how a shape is counted, :mod:`zerodp.plan.hf`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from zerodp.plan._common import ToDict, check_count, check_positive

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
#: the aspect ratio assumed when only a parameter count is given: hidden = 128 × layers
#: (Llama 3 8B: 4096 = 128 × 32), and 12·h² parameters per layer (guide §10.2 rounds to 16h²)
ASSUMED_HIDDEN_PER_LAYER = 128
ASSUMED_PARAMS_PER_LAYER_PER_H2 = 12


@dataclass(frozen=True)
class Model(ToDict):
    """A model as the planner sees it. ``to_dict()`` adds ``active``, ``embedding_params``,
    ``block_params``, ``unit_params`` (the largest block: one ZeRO-3 unit) and ``moe_factor``
    (E/k). For MoE, ``ffn`` is the MLP width a token passes through (k routed + shared experts,
    what activations scale with) and ``expert_ffn`` the width of one expert."""

    name: str
    params: float
    active_params: float | None = None
    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    ffn: int | None = None
    vocab: int | None = None
    experts: int = 1
    experts_per_token: int = 1
    tied_embeddings: bool = False
    source: str = ""
    kv_heads: int | None = None
    head_dim: int | None = None
    shared_experts: int = 0
    gated_mlp: bool = True
    largest_block: float | None = None
    embedding: float | None = None
    trainable: bool = False
    published_params: float | None = None
    expert_ffn: int | None = None
    #: the parsed config.json it was read from (None for a count or a preset without one): what
    #: :func:`zerodp.plan.ownership.model_tensors` rebuilds the tensors from; not in ``to_dict()``
    config: dict | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        check_positive("params", self.params)
        if self.active_params is not None:
            check_positive("active_params", self.active_params)
            if self.active_params > self.params * (1 + 1e-12):
                raise ValueError(f"active_params ({self.active_params:g}) > params ({self.params:g})")
        for name in ("layers", "hidden", "heads", "ffn", "vocab", "kv_heads", "head_dim"):
            if getattr(self, name) is not None:
                check_count(name, getattr(self, name))
        check_count("experts", self.experts)
        check_count("experts_per_token", self.experts_per_token)
        check_count("shared_experts", self.shared_experts, minimum=0)
        if self.experts_per_token > self.experts:
            raise ValueError(f"experts_per_token ({self.experts_per_token}) > experts ({self.experts})")
        if self.heads and self.kv_heads and self.kv_heads > self.heads:
            raise ValueError(f"kv_heads ({self.kv_heads}) > heads ({self.heads})")
        if self.heads and self.kv_heads and self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) is not a multiple of kv_heads ({self.kv_heads}): "
                             "grouped-query attention shares each key/value head among "
                             "heads/kv_heads query heads; give a divisor of heads")
        if self.layers and self.embedding_params >= self.params:
            raise ValueError(f"embedding parameters ({self.embedding_params:g}) exceed params "
                             f"({self.params:g}): check hidden/vocab")

    @property
    def active(self) -> float:
        """Parameters that compute on each token (Ψ for dense models)."""
        return self.params if self.active_params is None else self.active_params

    @property
    def moe_factor(self) -> float:
        """E/k: the roofline threshold grows by this factor for MoE (guide §7.3)."""
        return self.experts / self.experts_per_token

    @property
    def active_factor(self) -> float:
        """Ψ / active parameters: what a token's compute is to the parameters every step
        communicates; unlike E/k it counts shared experts, dense layers, attention and
        embeddings (DeepSeek-V2-Lite: 5.9 where E/k is 10.7; docs/planner.md)."""
        return self.params / self.active

    @property
    def embedding_params(self) -> float:
        """Input embedding plus (unless tied) output head: vocab·hidden each; 0 without a shape."""
        if self.embedding is not None:
            return self.embedding
        if not (self.vocab and self.hidden):
            return 0.0
        return float(self.vocab * self.hidden * (1 if self.tied_embeddings else 2))

    @property
    def block_params(self) -> float | None:
        """(Ψ − embeddings)/L, parameters of an average transformer block; None without layers."""
        return None if not self.layers else (self.params - self.embedding_params) / self.layers

    @property
    def unit_params(self) -> float | None:
        """Parameters of the largest block: what one gathered ZeRO-3 unit holds (guide §9.3)."""
        return self.largest_block if self.largest_block is not None else self.block_params

    @property
    def active_block_params(self) -> float | None:
        if not self.layers:
            return None
        return max(self.active - self.embedding_params, 0.0) / self.layers

    @property
    def q_dim(self) -> int | None:
        return self.heads * self.head_dim if self.heads and self.head_dim else self.hidden

    @property
    def kv_dim(self) -> int | None:
        if not self.heads:
            return self.hidden
        hd = self.head_dim or (self.hidden // self.heads if self.hidden else None)
        return (self.kv_heads or self.heads) * hd if hd else self.hidden

    def require_shape(self, *names: str) -> None:
        missing = [n for n in names if getattr(self, n) is None]
        if missing:
            raise ValueError(f"model {self.name!r} has no {', '.join(missing)}: give --config "
                             f"config.json, a shape (--layers/--hidden/--heads) or a preset with "
                             f"a shape (every preset but a bare parameter count has one)")

    def to_dict(self) -> dict:
        d = super().to_dict()
        d.pop("config", None)
        d.update(active=self.active, moe_factor=self.moe_factor, active_factor=self.active_factor,
                 embedding_params=self.embedding_params, block_params=self.block_params,
                 unit_params=self.unit_params, active_block_params=self.active_block_params)
        return d


def assumed_shape(params: float) -> tuple[int, int]:
    """(layers, hidden) of a dense transformer of ``params`` parameters when none is given:
    12·L·h² = Ψ with h = 128·L, rounded to whole layers and a multiple of 128."""
    check_positive("params", params)
    layers = max(1, round((params / (ASSUMED_PARAMS_PER_LAYER_PER_H2 *
                                     ASSUMED_HIDDEN_PER_LAYER ** 2)) ** (1 / 3)))
    hidden = max(128, 128 * round(math.sqrt(params / (ASSUMED_PARAMS_PER_LAYER_PER_H2 * layers)) / 128))
    return layers, hidden
