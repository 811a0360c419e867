"""Parameter counts and shapes from a Hugging Face ``config.json`` (guide §2.4, §7.3, §9.3).

Families read:

* Llama / Mistral / Qwen2-style dense decoders: grouped-query attention (``num_key_value_heads``),
  SwiGLU MLP (gate, up, down: 3·h·ffn), RMSNorm, optional q/k/v biases (Qwen2), tied embeddings
  (``tie_word_embeddings``);
* Mixtral / gpt-oss / Qwen2-MoE-style MoE: ``num_local_experts`` or ``num_experts`` routed experts,
  ``num_experts_per_tok`` of them per token, a router per layer;
* DeepSeek-V2/V3: multi-head latent attention (``q_lora_rank``, ``kv_lora_rank``,
  ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``), ``n_routed_experts`` of width
  ``moe_intermediate_size`` plus ``n_shared_experts`` that always run, the first
  ``first_k_dense_replace`` layers dense; the multi-token-prediction module is not counted;
* GPT-2 (and the GPT ``zerodp train`` builds): learned positions, LayerNorm with bias, biases in
  every linear layer, a 2-matrix GELU MLP.

Only the fields that change a count are read; unknown families with these fields are read as
Llama-style. A config can carry a ``"_zerodp"`` object (``source``, ``published_params``,
``trainable``, or ``params`` alone for a model known only by its count).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from zerodp.plan.model import Model

#: a config.json is a few kB; refuse anything much larger before parsing it
MAX_CONFIG_BYTES = 1_000_000
#: no dimension of a real model comes near these; they keep every count quick and finite
MAX_DIM = 1_000_000_000
MAX_LAYERS = 100_000
_GPT2 = ("gpt2", "zerodp-gpt")
#: model_type values counted here (module docstring); "" for a config without one, and the
#: shapes typed by hand. Anything else (mamba, rwkv, t5, ...) is refused: its parameters are not
#: a decoder's blocks
KNOWN_TYPES = ("", "llama", "mistral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "mixtral",
               "deepseek_v2", "deepseek_v3", "gpt_oss", "gpt2", "zerodp-gpt", "shape",
               "shape-gelu", "config")


@dataclass(frozen=True)
class _Count:
    attention: float   # per layer
    dense_mlp: float   # per dense layer
    expert: float      # one routed expert
    shared: float      # all shared experts of one MoE layer
    router: float      # per MoE layer
    norms: float       # per layer
    moe_layers: int
    embedding: float   # input + output (+ positions)
    final_norm: float


def _get(cfg: dict, *names, default=None):
    for n in names:
        if n in cfg and cfg[n] is not None:
            return cfg[n]
    return default


def _int(cfg: dict, *names, default=None, minimum: int = 1, maximum: int = MAX_DIM,
         required: bool = False) -> int | None:
    """The first of ``names`` present in ``cfg``, as a whole number in [minimum, maximum]."""
    v = _get(cfg, *names, default=default)
    if v is None:
        if required:
            raise ValueError(f"config.json has no {names[0]}, which this model family needs")
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v \
            or not float(v).is_integer() or not minimum <= v <= maximum:
        raise ValueError(f"config.json: {names[0]} must be a whole number from {minimum:,} to "
                         f"{maximum:,}, got {v!r}")
    return int(v)


def model_from_config(cfg: dict, name: str | None = None, source: str = "") -> Model:
    """A :class:`Model` from a parsed ``config.json`` (module docstring for the fields read)."""
    if not isinstance(cfg, dict):
        raise ValueError("config.json must hold a JSON object (the model's configuration)")
    meta = cfg.get("_zerodp", {}) or {}
    mt = str(cfg.get("model_type", "")).lower()
    if mt not in KNOWN_TYPES:
        raise ValueError(f"config.json: model_type {mt!r} is not a decoder this planner counts "
                         f"(known: {', '.join(t for t in KNOWN_TYPES[1:13])}); give a shape with "
                         "--params/--layers/--hidden instead")
    name = name or str(_get(cfg, "_name_or_path", default="") or mt or "config")
    source = meta.get("source", source)
    if "params" in meta and not any(k in cfg for k in ("hidden_size", "n_embd", "d_model")):
        return Model(name=name, params=float(meta["params"]), source=source,
                     published_params=float(meta["params"]))
    h = _int(cfg, "hidden_size", "n_embd", "d_model")
    layers = _int(cfg, "num_hidden_layers", "n_layer", "num_layers", maximum=MAX_LAYERS)
    heads = _int(cfg, "num_attention_heads", "n_head")
    vocab = _int(cfg, "vocab_size")
    missing = [f for f, v in (("hidden_size", h), ("num_hidden_layers", layers),
                              ("num_attention_heads", heads), ("vocab_size", vocab)) if v is None]
    if missing:
        raise ValueError(f"config.json has no {', '.join(missing)}: is it a transformer's "
                         "Hugging Face config?")
    gpt2 = mt in _GPT2
    kv = _int(cfg, "num_key_value_heads", default=heads)
    if kv > heads or heads % kv:
        raise ValueError(f"config.json: num_attention_heads ({heads}) must be a multiple of "
                         f"num_key_value_heads ({kv}) (grouped-query attention)")
    head_dim = _int(cfg, "head_dim", default=None)
    if head_dim is None:
        if h % heads:
            raise ValueError(f"config.json: hidden_size ({h}) is not a multiple of "
                             f"num_attention_heads ({heads}); give head_dim")
        head_dim = h // heads
    ffn = _int(cfg, "intermediate_size", "n_inner", "ffn_dim", default=4 * h)
    tied = bool(cfg.get("tie_word_embeddings", gpt2))
    experts = _int(cfg, "num_local_experts", "n_routed_experts", "num_experts", default=1,
                   maximum=1_000_000)
    k = _int(cfg, "num_experts_per_tok", "moe_topk", default=1 if experts == 1 else 2)
    if k > experts:
        raise ValueError(f"config.json: num_experts_per_tok ({k}) > experts ({experts})")
    moe_ffn = _int(cfg, "moe_intermediate_size", default=ffn)
    n_shared = _int(cfg, "n_shared_experts", default=0, minimum=0)
    shared_ffn = _int(cfg, "shared_expert_intermediate_size", default=0, minimum=0)
    first_dense = _int(cfg, "first_k_dense_replace", default=0, minimum=0)
    freq = _int(cfg, "moe_layer_freq", default=1)
    if experts > 1:
        moe_layers = sum(1 for i in range(layers) if i >= first_dense and i % freq == 0)
    else:
        moe_layers = 0

    # attention, per layer
    if cfg.get("kv_lora_rank"):
        q_lora = _int(cfg, "q_lora_rank", default=0, minimum=0)
        kv_lora = _int(cfg, "kv_lora_rank", required=True)
        nope = _int(cfg, "qk_nope_head_dim", required=True)
        rope = _int(cfg, "qk_rope_head_dim", required=True)
        v_dim = _int(cfg, "v_head_dim", required=True)
        qk = heads * (nope + rope)
        q = (h * q_lora + q_lora + q_lora * qk) if q_lora else h * qk
        attn = q + h * (kv_lora + rope) + kv_lora + kv_lora * heads * (nope + v_dim) + heads * v_dim * h
        q_dim = qk
    else:
        q_dim, kv_dim = heads * head_dim, kv * head_dim
        attn = h * q_dim + 2 * h * kv_dim + q_dim * h
        if gpt2 or cfg.get("attention_bias"):
            attn += q_dim + 2 * kv_dim + h
        elif mt.startswith("qwen2"):  # Qwen2: biases on q, k, v only
            attn += q_dim + 2 * kv_dim
        if mt == "gpt_oss":  # one attention sink per head
            attn += heads
    # MLP
    gated = not gpt2
    mlp_bias = gpt2 or bool(cfg.get("mlp_bias"))

    def mlp(width):
        if gated:
            return 3 * h * width + ((2 * width + h) if mlp_bias else 0)
        return 2 * h * width + ((width + h) if mlp_bias else 0)

    expert = mlp(moe_ffn) + ((2 * moe_ffn + h) if mt == "gpt_oss" else 0)
    shared = n_shared * mlp(moe_ffn) + ((mlp(shared_ffn) + h) if shared_ffn else 0)
    router = experts * h + (experts if mt in ("gpt_oss", "deepseek_v3") else 0)
    norms = (4 * h) if gpt2 else (2 * h)
    positions = _int(cfg, "n_positions", default=0, minimum=0) if gpt2 else 0
    embedding = vocab * h * (1 if tied else 2) + positions * h
    final_norm = (2 * h) if gpt2 else h
    c = _Count(attn, mlp(ffn), expert, shared, router, norms, moe_layers, embedding, final_norm)
    dense_layers = layers - moe_layers
    dense_block = c.attention + c.norms + c.dense_mlp
    moe_block = c.attention + c.norms + experts * c.expert + c.shared + c.router
    total = dense_layers * dense_block + moe_layers * moe_block + c.embedding + c.final_norm
    active = total - moe_layers * (experts - k) * c.expert
    per_token_ffn = ffn if moe_layers == 0 else k * moe_ffn + n_shared * moe_ffn + shared_ffn
    return Model(
        name=name, params=float(total), active_params=float(active) if moe_layers else None,
        layers=layers, hidden=h, heads=heads, ffn=per_token_ffn, vocab=vocab, experts=experts,
        experts_per_token=k, tied_embeddings=tied, source=source or f"config.json ({mt or 'no model_type'})",
        kv_heads=kv, head_dim=q_dim // heads, shared_experts=n_shared, gated_mlp=gated,
        largest_block=float(max(dense_block if dense_layers else 0, moe_block if moe_layers else 0)),
        embedding=float(embedding + final_norm), trainable=bool(meta.get("trainable", False)),
        published_params=float(meta["published_params"]) if "published_params" in meta else None,
        expert_ffn=moe_ffn if moe_layers else None, config=cfg)


def shape_model(name: str, layers: int, hidden: int, heads: int, heads_given: bool,
                kv_heads: int | None, ffn: int, vocab: int, experts: int, experts_per_token: int,
                shared_experts: int, tied: bool, gated: bool) -> Model:
    """A model from a shape typed by hand (the page's shape editor, ``--layers/--hidden/...``):
    the same counting as a config.json of that shape."""
    cfg = {"model_type": "llama" if gated else "shape", "hidden_size": hidden,
           "num_hidden_layers": layers, "num_attention_heads": heads, "vocab_size": max(vocab, 1),
           "intermediate_size": ffn, "tie_word_embeddings": tied}
    if kv_heads is not None:
        cfg["num_key_value_heads"] = kv_heads
    if experts > 1 or shared_experts:
        cfg.update(num_local_experts=experts, num_experts_per_tok=experts_per_token,
                   n_shared_experts=shared_experts)
    if hidden % heads:
        cfg["head_dim"] = max(1, hidden // heads)
    if not gated:
        cfg["model_type"] = "shape-gelu"
    m = model_from_config(cfg, name=name, source="shape given by hand" +
                          ("" if heads_given else "; heads assumed"))
    if not gated:  # a 2-matrix MLP without biases: the 12h²-per-layer GPT of guide §10.2
        per_layer = 4 * hidden * hidden + 2 * hidden * ffn + 2 * hidden
        emb = 2 * vocab * hidden if not tied else vocab * hidden
        from dataclasses import replace
        total = layers * per_layer + emb + hidden
        m = replace(m, params=float(total), largest_block=float(per_layer),
                    embedding=float(emb + hidden), gated_mlp=False, ffn=ffn, active_params=None)
    if not vocab:
        from dataclasses import replace
        m = replace(m, vocab=None, params=m.params - m.embedding_params + (hidden if gated else 0),
                    embedding=0.0 if gated else 0.0)
    if not heads_given:
        from dataclasses import replace
        m = replace(m, heads=None)
    return m


def load_config(path: str, name: str | None = None) -> Model:
    """A :class:`Model` from a ``config.json`` file, or a directory that holds one."""
    p = os.path.expanduser(str(path))
    if os.path.isdir(p):
        p = os.path.join(p, "config.json")
    if not os.path.isfile(p):
        raise FileNotFoundError(f"--config {path}: no such file (give a config.json, or a model "
                                "directory that holds one)")
    if os.path.getsize(p) > MAX_CONFIG_BYTES:
        raise ValueError(f"--config {path}: {os.path.getsize(p):,} bytes is too large for a "
                         "config.json (a model's weights?); give the config.json itself")
    with open(p, encoding="utf-8", errors="replace") as f:
        text = f.read()
    try:
        return parse_config(text, name=name or _name_from(p), source=f"config.json at {p}")
    except ValueError as exc:  # the message names the file given, not "config.json"
        msg = str(exc)
        raise ValueError(f"--config {path} {msg[len('config.json '):]}" if msg.startswith("config.json ")
                         else f"--config {path}: {msg}") from None


def parse_config(text: str, name: str = "config.json", source: str = "config.json") -> Model:
    """A :class:`Model` from the text of a ``config.json`` (the page's paste box)."""
    if len(text) > MAX_CONFIG_BYTES:
        raise ValueError("config.json text is too long (over 1 MB): paste the config.json itself")
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"config.json is not valid JSON (line {exc.lineno}, column {exc.colno}: "
                         f"{exc.msg})") from None
    except RecursionError:
        raise ValueError("config.json nests too deeply to be a model's configuration") from None
    return model_from_config(cfg, name=name, source=source)


def _name_from(path: str) -> str:
    folder = os.path.basename(os.path.dirname(os.path.abspath(path)))
    return folder or "config.json"
