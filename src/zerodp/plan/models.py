"""Model presets and custom shapes (seed §2.4, §7.2, §7.3, §9.4).

A :class:`Model` has a total parameter count Ψ, an active count per token (MoE: only k of E
experts run), and optionally a transformer shape (layers, hidden, heads, ffn, vocab) for the
activation ledger and the per-layer timeline. Presets use the published totals; per-block sizes
are derived as (Ψ − embedding parameters)/layers, so the blocks add up to the published Ψ.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerodp.plan._common import ToDict, check_count, check_positive

BF16 = 2


@dataclass(frozen=True)
class Model(ToDict):
    """A model as the planner sees it. ``to_dict()`` adds ``embedding_params``, ``block_params``,
    ``active_block_params`` and ``moe_factor`` (E/k) when a shape is known."""

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

    def __post_init__(self):
        check_positive("params", self.params)
        if self.active_params is not None:
            check_positive("active_params", self.active_params)
            if self.active_params > self.params:
                raise ValueError(f"active_params ({self.active_params:g}) > params ({self.params:g})")
        for name in ("layers", "hidden", "heads", "ffn", "vocab"):
            if getattr(self, name) is not None:
                check_count(name, getattr(self, name))
        check_count("experts", self.experts)
        check_count("experts_per_token", self.experts_per_token)
        if self.experts_per_token > self.experts:
            raise ValueError(f"experts_per_token ({self.experts_per_token}) > experts ({self.experts})")
        if self.layers and self.embedding_params >= self.params:
            raise ValueError(f"embedding parameters ({self.embedding_params:g}) exceed params "
                             f"({self.params:g}): check hidden/vocab")

    @property
    def active(self) -> float:
        """Parameters that compute on each token (Ψ for dense models)."""
        return self.params if self.active_params is None else self.active_params

    @property
    def moe_factor(self) -> float:
        """E/k: the roofline threshold grows by this factor for MoE (seed §7.3)."""
        return self.experts / self.experts_per_token

    @property
    def embedding_params(self) -> float:
        """Input embedding plus (unless tied) output head: vocab·hidden each; 0 without a shape."""
        if not (self.vocab and self.hidden):
            return 0.0
        return float(self.vocab * self.hidden * (1 if self.tied_embeddings else 2))

    @property
    def block_params(self) -> float | None:
        """(Ψ − embeddings)/L, parameters of one transformer block; None without ``layers``."""
        return None if not self.layers else (self.params - self.embedding_params) / self.layers

    @property
    def active_block_params(self) -> float | None:
        if not self.layers:
            return None
        return max(self.active - self.embedding_params, 0.0) / self.layers

    def require_shape(self, *names: str) -> None:
        missing = [n for n in names if getattr(self, n) is None]
        if missing:
            raise ValueError(f"model {self.name!r} has no {', '.join(missing)}: give them "
                             f"(e.g. --layers/--hidden/--heads) or pick a preset with a shape: "
                             f"{', '.join(n for n, m in PRESETS.items() if m.layers)}")

    def to_dict(self) -> dict:
        d = super().to_dict()
        d.update(active=self.active, moe_factor=self.moe_factor,
                 embedding_params=self.embedding_params, block_params=self.block_params,
                 active_block_params=self.active_block_params)
        return d


PRESETS: dict[str, Model] = {m.name: m for m in [
    Model("zero-7.5b", params=7.5e9,
          source="ZeRO paper (Rajbhandari et al. 2020) memory example: Ψ = 7.5B, k = 12 (seed §9.4)"),
    Model("llama3-8b", params=8.03e9, layers=32, hidden=4096, heads=32, ffn=14336, vocab=128256,
          source="The Llama 3 Herd of Models, Table 3"),
    Model("llama3-70b", params=70.6e9, layers=80, hidden=8192, heads=64, ffn=28672, vocab=128256,
          source="The Llama 3 Herd of Models, Table 3"),
    Model("llama3-405b", params=405.9e9, layers=126, hidden=16384, heads=128, ffn=53248,
          vocab=128256, source="The Llama 3 Herd of Models, Table 3"),
    Model("gpt-oss-120b", params=116.8e9, active_params=5.13e9, layers=36, hidden=2880, heads=64,
          ffn=2880, vocab=201088, experts=128, experts_per_token=4,
          source="gpt-oss model card: 128 experts, top-4 (seed §7.3)"),
    Model("deepseek-v3", params=671e9, active_params=37e9, layers=61, hidden=7168, heads=128,
          ffn=2048, vocab=129280, experts=256, experts_per_token=8,
          source="DeepSeek-V3 Technical Report: 256 routed experts, top-8 (seed §7.2, §7.3)"),
]}


def model_names() -> list[str]:
    return list(PRESETS)


def _normalize(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum() or ch == ".")


def get_model(name: str | Model) -> Model:
    """A preset by name (case and dashes ignored: "Llama3-8B", "llama3_8b")."""
    if isinstance(name, Model):
        return name
    key = _normalize(str(name))
    for preset_name, model in PRESETS.items():
        if _normalize(preset_name) == key:
            return model
    raise ValueError(f"unknown model {name!r}: use one of {', '.join(PRESETS)} "
                     "or give --params (and optionally a shape)")


def custom_model(params: float | None = None, layers: int | None = None, hidden: int | None = None,
                 heads: int | None = None, ffn: int | None = None, vocab: int | None = None,
                 experts: int = 1, experts_per_token: int = 1, name: str = "custom") -> Model:
    """A model from a parameter count and/or a transformer shape.

    Without ``params`` the shape must be complete and Ψ = L·(4h² + 2h·ffn) + embeddings
    (a GPT block with a 2-matrix MLP), the 12h²-per-layer count for ffn = 4h.
    """
    if params is None:
        if layers is None or hidden is None:
            raise ValueError("give params, or a shape with at least layers and hidden")
        f = ffn or 4 * hidden
        params = layers * (4 * hidden * hidden + 2 * hidden * f) + 2 * (vocab or 0) * hidden
    return Model(name=name, params=params, layers=layers, hidden=hidden, heads=heads, ffn=ffn,
                 vocab=vocab, experts=experts, experts_per_token=experts_per_token)
