"""Models as the planner sees them: presets shipped as ``config.json`` files, a user's own
``config.json``, or a shape typed by hand (guide §2.4, §7.2, §7.3, §9.4).

A :class:`Model` has a total parameter count Ψ, the count active per token (MoE: k of E routed
experts, plus shared experts), and when known its transformer shape: layers, hidden size, heads,
key/value heads (grouped-query attention), FFN width, vocabulary, experts. Parameter counts come
from the shape (:mod:`zerodp.plan.hf`); the presets are Hugging Face-style configs in
``zerodp/plan/configs/`` and their counts match the published ones within 0.5 %.

One list serves both the planner and ``zerodp train``: presets marked ``trainable`` are the GPTs
the trainer builds (nano ... gpt2-small); the others are planner-only.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping

from zerodp.plan.hf import model_from_config, shape_model
from zerodp.plan.model import (ASSUMED_HIDDEN_PER_LAYER, ASSUMED_PARAMS_PER_LAYER_PER_H2,  # noqa: F401
                               CONFIG_DIR, Model, assumed_shape)

@functools.lru_cache(maxsize=1)
def presets() -> dict[str, Model]:
    """Every preset, read once from the configs shipped in ``zerodp/plan/configs``, in the order
    ``model_names()`` lists them."""
    out = {}
    for name in _ORDER:
        with open(os.path.join(CONFIG_DIR, f"{name}.json"), encoding="utf-8") as f:
            out[name] = model_from_config(json.load(f), name=name)
    return out


# the order of ``zerodp plan --help`` and the page's menu: trainer GPTs, then by size
_ORDER = ["nano", "tiny", "small", "medium", "gpt2-small", "zero-7.5b", "qwen2-7b", "llama3-8b",
          "mixtral-8x7b", "llama3-70b", "gpt-oss-120b", "llama3-405b", "deepseek-v3"]


class _Presets(Mapping):
    """``PRESETS``: the preset table by name, read on first use (:func:`presets`)."""

    def __getitem__(self, k):
        return presets()[k]

    def __iter__(self):
        return iter(presets())

    def __len__(self):
        return len(presets())

    def __repr__(self):
        return repr(presets())


PRESETS: Mapping[str, Model] = _Presets()


def model_names(trainable: bool | None = None) -> list[str]:
    """Preset names; ``trainable=True``: only those ``zerodp train`` can build, ``False``: only
    the planner-only ones."""
    return [n for n, m in presets().items() if trainable is None or m.trainable == trainable]


def _normalize(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum() or ch == ".")


def get_model(name: str | Model) -> Model:
    """A preset by name (case and dashes ignored: "Llama3-8B", "llama3_8b")."""
    if isinstance(name, Model):
        return name
    key = _normalize(str(name))
    for preset_name, model in presets().items():
        if _normalize(preset_name) == key:
            return model
    raise ValueError(f"unknown model {name!r}: use one of {', '.join(presets())}, "
                     "or give --config config.json or --params")


def custom_model(params: float | None = None, layers: int | None = None, hidden: int | None = None,
                 heads: int | None = None, ffn: int | None = None, vocab: int | None = None,
                 experts: int = 1, experts_per_token: int = 1, name: str = "custom",
                 kv_heads: int | None = None, shared_experts: int = 0,
                 tied_embeddings: bool = False, gated_mlp: bool | None = None) -> Model:
    """A model from a parameter count and/or a transformer shape.

    With ``layers`` and ``hidden`` the count comes from the shape (:func:`zerodp.plan.hf.count`):
    grouped-query attention with ``kv_heads``, a SwiGLU MLP of width ``ffn`` (default: a 2-matrix
    4h MLP, the 12h²-per-layer GPT), ``experts`` routed experts of which ``experts_per_token`` run,
    ``shared_experts`` that always run. ``params`` alone keeps that count and assumes a shape
    (:func:`assumed_shape`; ``to_dict()["assumed_shape"]`` says so). Both: the shape is used for
    activations and units, ``params`` for the states.
    """
    if layers is None and hidden is None and heads is None and ffn is None and vocab is None:
        if params is None:
            raise ValueError("give params, or a shape with at least layers and hidden")
        if experts != 1 or experts_per_token != 1 or kv_heads is not None or shared_experts:
            raise ValueError("experts, kv_heads and shared experts need a shape: give layers and "
                             "hidden too")
        return Model(name=name, params=params, source="parameter count only; shape assumed")
    if hidden is None and params is not None and layers is not None and vocab is None \
            and heads is None and ffn is None and experts == 1:
        return Model(name=name, params=params, layers=layers,
                     source="parameter count and layers; block sizes Ψ/L")
    if layers is None or hidden is None:
        raise ValueError("a shape needs at least layers and hidden (and heads for activations)")
    gated = ffn is not None if gated_mlp is None else gated_mlp
    m = shape_model(name=name, layers=layers, hidden=hidden, heads=heads or max(1, hidden // 128),
                    heads_given=heads is not None, kv_heads=kv_heads,
                    ffn=ffn or 4 * hidden, vocab=vocab or 0, experts=experts,
                    experts_per_token=experts_per_token, shared_experts=shared_experts,
                    tied=tied_embeddings, gated=gated)
    if params is not None:
        from dataclasses import replace
        return replace(m, params=params, active_params=None if experts == 1 else m.active_params,
                       largest_block=None, embedding=None,
                       source=m.source + "; parameter count given")
    return m
