"""From a sharded checkpoint to a plain model: ``zerodp export`` and ``zerodp sample``.

No engine and no process group are needed: the full parameters are assembled from the pieces
of every rank (:meth:`Checkpoint.full`), exactly as a loader at world size 1 would see them.

Formats (``zerodp export --format``):

- ``safetensors`` (default): one file, the bundled GPT's ``state_dict`` with its config in the
  metadata (:func:`export`);
- ``hf``: a Hugging Face directory — ``model-0000i-of-0000N.safetensors`` shards and
  ``model.safetensors.index.json``. The bundled GPT is GPT-2's architecture (learned positions,
  pre-LayerNorm blocks, exact GELU), so it is written as a ``GPT2LMHeadModel`` with
  ``config.json`` and ``generation_config.json``, which ``AutoModelForCausalLM.from_pretrained``
  loads and which gives the same logits; any other model is keyed by the names its checkpoint
  holds (:func:`export_hf`, :func:`zerodp.engine.hf.save_hf`);
- ``dcp``: a ``torch.distributed.checkpoint`` directory (:func:`zerodp.engine.dcp.export_dcp`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from zerodp.train import checkpoint as ckpt
from zerodp.train.data import decode
from zerodp.train.model import GPT, GPTConfig

CONFIG_KEY = "zerodp_model_config"
KIND_KEY = "zerodp_token_kind"
FORMATS = ("safetensors", "hf", "dcp")
HF_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def model_from_checkpoint(path: str | Path, log=print) -> tuple[GPT, "ckpt.Checkpoint"]:
    """A single-process GPT holding a checkpoint's parameters (fp32 master values)."""
    ck = ckpt.Checkpoint.open(ckpt.find(path, log=log))
    try:
        mc = GPTConfig(**ck.model_config)
    except TypeError as e:
        raise ckpt.CheckpointError(f"{ck.path / ckpt.MANIFEST} has a model config this GPT does not "
                                   f"understand: {e}") from None
    model = GPT(mc)
    state = {}
    for name, p in model.named_parameters():  # shared (tied) parameters appear once, as in the engine
        if name not in ck.shapes:
            raise ckpt.CheckpointError(f"{ck.path / ckpt.MANIFEST} has no parameter {name}")
        state[name] = ck.full(name, "param").to(p.dtype)
    missing = model.load_state_dict(state, strict=False).missing_keys
    aliased = {n for n, _ in model.named_parameters(remove_duplicate=False)} - set(state)
    if set(missing) - aliased:
        raise ckpt.CheckpointError(f"{ck.path} lacks {sorted(set(missing) - aliased)}")
    return model, ck


def export(path: str | Path, out: str | Path, log=print) -> Path:
    """Write the checkpoint's parameters as a plain ``state_dict`` safetensors file.

    ``GPT(cfg).load_state_dict(safetensors.torch.load_file(out))`` loads it; the model config is in
    the file's metadata (``zerodp_model_config``) so the file is self-describing.
    """
    model, ck = model_from_checkpoint(path, log=log)
    out = Path(out)
    if out.suffix != ".safetensors":
        raise ValueError(f"export writes safetensors: give an output path ending in .safetensors, got {out}")
    # safetensors refuses tensors that share memory (tied weights): give each key its own copy.
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    kind = ck.manifest.get("data", {}).get("kind", "bytes")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_bytes(safetensors_bytes(sd, {CONFIG_KEY: json.dumps(model.cfg.to_dict(), sort_keys=True),
                                           KIND_KEY: kind, "step": str(ck.step)}))
    tmp.replace(out)
    return out


def safetensors_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """A safetensors file whose bytes depend only on the tensors and the metadata.

    safetensors keeps the metadata in a hash map, so its order in the JSON header (and with it the
    file's bytes) changes from one process to the next. The header is re-written with its keys
    sorted; the data section and its offsets, which the header gives relative to the data's start,
    are unchanged, and the header is padded with spaces to a multiple of 8 bytes as the format asks.
    """
    from safetensors.torch import save

    raw = save(tensors, metadata=metadata)
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + raw[8 + n:]


def checkpoint_state(path: str | Path, log=print) -> tuple[dict[str, torch.Tensor], "ckpt.Checkpoint"]:
    """Every parameter (fp32 master values) and persistent buffer of a checkpoint, by the model's
    own names, assembled from all ranks' pieces; no model class is needed."""
    ck = ckpt.Checkpoint.open(ckpt.find(path, log=log))
    state = {}
    for name in ck.names():
        kinds = ck.kinds(name)
        if "param" in kinds:
            state[name] = ck.full(name, "param")
        elif "buffer" in kinds:
            state[name] = ck.full(name, "buffer")
    if not state:
        raise ckpt.CheckpointError(f"{ck.path / ckpt.MANIFEST} lists no parameters: there is nothing to export")
    return state, ck


def checkpoint_sources(path: str | Path, log=print) -> tuple[dict, "ckpt.Checkpoint"]:
    """:func:`checkpoint_state` without reading a tensor: each parameter (fp32 master values) and
    persistent buffer as a :class:`zerodp.engine.hf.TensorSource` that assembles it from the
    ranks' pieces when it is written, so an export holds one tensor at a time."""
    from zerodp.engine.hf import TensorSource

    ck = ckpt.Checkpoint.open(ckpt.find(path, log=log))
    sources = {}
    for name in ck.names():
        kinds = ck.kinds(name)
        kind = "param" if "param" in kinds else "buffer" if "buffer" in kinds else None
        if kind is None:
            continue
        dtype = getattr(torch, ck.dtypes[(name, kind)])
        sources[name] = TensorSource(tuple(ck.shapes[name]), dtype, lambda name=name, kind=kind: ck.full(name, kind))
    if not sources:
        raise ckpt.CheckpointError(f"{ck.path / ckpt.MANIFEST} lists no parameters: there is nothing to export")
    return sources, ck


def export_hf(path: str | Path, out: str | Path, dtype: str = "float32",
              max_shard_bytes: int | None = None, log=print, native_names: bool = False) -> Path:
    """Write a checkpoint as a Hugging Face directory: sharded safetensors plus
    ``model.safetensors.index.json`` (in its ``metadata``: the step and, for the bundled GPT, its
    zerodp config).

    The bundled GPT is written as ``transformers``' ``GPT2LMHeadModel`` (:func:`gpt2_state`,
    :func:`gpt2_config`) with ``config.json`` and ``generation_config.json``, so that
    ``AutoModelForCausalLM.from_pretrained(out)`` loads it; ``native_names=True`` keeps its own
    names instead (what ``zerodp.engine.hf.load_hf`` reads back into a GPT engine). Any other
    model is written by the names its checkpoint holds, without a config. It streams: each tensor
    is assembled from the checkpoint's pieces, renamed, written and dropped in turn
    (:func:`checkpoint_sources`), so the process holds one tensor at a time, not the model."""
    from zerodp.engine.hf import DEFAULT_MAX_SHARD_BYTES, save_hf

    if dtype not in HF_DTYPES:
        raise ValueError(f"--dtype {dtype} is not one of {', '.join(HF_DTYPES)}")
    out = Path(out)
    if out.suffix == ".safetensors":
        raise ValueError(f"--format hf writes a directory: give a directory path, not {out}")
    state, ck = checkpoint_sources(path, log=log)
    meta: dict = {"step": ck.step, "source": str(ck.path)}
    config = None
    if ck.model_config:
        meta[CONFIG_KEY] = ck.model_config
        meta[KIND_KEY] = ck.manifest.get("data", {}).get("kind", "bytes")
        if not native_names:
            mc = GPTConfig(**ck.model_config)
            state, config = gpt2_state(state, mc), gpt2_config(mc, dtype)
    written = save_hf(state, out, dtype=HF_DTYPES[dtype], metadata=meta, config=config,
                      max_shard_bytes=DEFAULT_MAX_SHARD_BYTES if max_shard_bytes is None else max_shard_bytes)
    if config is not None:
        (out / GENERATION_CONFIG).write_text(json.dumps(generation_config(), indent=2, sort_keys=True) + "\n")
    return written


GENERATION_CONFIG = "generation_config.json"


def gpt2_config(mc: GPTConfig, dtype: str = "float32") -> dict:
    """``transformers.GPT2Config`` of the bundled GPT, as config.json holds it. The GPT is GPT-2's
    architecture: learned positions, pre-LayerNorm blocks (eps 1e-5), exact GELU (GPT-2's own is
    the tanh approximation, ``gelu_new``, so ``activation_function`` says ``gelu``), a head without
    bias. There are no special tokens (the byte-level vocabulary has none)."""
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": mc.vocab_size, "n_positions": mc.seq_len, "n_embd": mc.d_model,
        "n_layer": mc.n_layer, "n_head": mc.n_head, "n_inner": mc.ffn_mult * mc.d_model,
        "activation_function": "gelu", "layer_norm_epsilon": 1e-5,
        "resid_pdrop": mc.dropout, "embd_pdrop": mc.dropout, "attn_pdrop": mc.dropout,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "tie_word_embeddings": mc.tie_weights, "use_cache": True,
        "bos_token_id": None, "eos_token_id": None, "torch_dtype": dtype, "dtype": dtype,
    }


def generation_config() -> dict:
    """``zerodp sample``'s defaults as generation_config.json: top-k sampling at temperature 0.8."""
    return {"do_sample": True, "temperature": 0.8, "top_k": 40, "max_new_tokens": 300}


def gpt2_state(state: dict[str, torch.Tensor], mc: GPTConfig) -> dict[str, torch.Tensor]:
    """The bundled GPT's parameters under GPT-2's names: ``transformers`` keeps GPT-2's linear
    layers as ``Conv1D``, whose weight is the transpose of ``nn.Linear``'s; a GPT built with
    ``bias=False`` gets zero biases, which compute the same. ``state``'s values may be tensors or
    :class:`zerodp.engine.hf.TensorSource` (then so are the results: still unread)."""
    from zerodp.engine.hf import TensorSource

    d, ffn = mc.d_model, mc.ffn_mult * mc.d_model
    lazy = any(isinstance(v, TensorSource) for v in state.values())

    def get(name: str, shape=None):
        if name in state:
            return state[name]
        if shape is not None and name.endswith(".bias"):
            if lazy:
                return TensorSource((shape,), torch.float32, lambda: torch.zeros(shape, dtype=torch.float32))
            return torch.zeros(shape, dtype=torch.float32)
        raise ckpt.CheckpointError(f"the checkpoint lacks {name}, which a GPT of this config holds")

    def transposed(v):
        if isinstance(v, TensorSource):
            return v.map(lambda t: t.t().contiguous(), tuple(reversed(v.shape)))
        return v.t().contiguous()

    out = {"transformer.wte.weight": get("tok_emb.weight"), "transformer.wpe.weight": get("pos_emb.weight")}
    for i in range(mc.n_layer):
        src, dst = f"blocks.{i}.", f"transformer.h.{i}."
        for a, b, n in (("ln1", "ln_1", d), ("ln2", "ln_2", d)):
            out[f"{dst}{b}.weight"] = get(f"{src}{a}.weight")
            out[f"{dst}{b}.bias"] = get(f"{src}{a}.bias", n)
        for a, b, n in (("attn.qkv", "attn.c_attn", 3 * d), ("attn.proj", "attn.c_proj", d),
                        ("mlp.fc", "mlp.c_fc", ffn), ("mlp.proj", "mlp.c_proj", d)):
            out[f"{dst}{b}.weight"] = transposed(get(f"{src}{a}.weight"))
            out[f"{dst}{b}.bias"] = get(f"{src}{a}.bias", n)
    out["transformer.ln_f.weight"] = get("ln_f.weight")
    out["transformer.ln_f.bias"] = get("ln_f.bias", d)
    out["lm_head.weight"] = get("tok_emb.weight") if mc.tie_weights else get("head.weight")
    return out


def export_dcp_dir(path: str | Path, out: str | Path, log=print) -> Path:
    """Write a checkpoint's parameters and buffers (fp32) as a ``torch.distributed.checkpoint``
    directory, through :func:`zerodp.engine.dcp.export_dcp`."""
    from zerodp.engine.dcp import export_dcp

    out = Path(out)
    if out.suffix == ".safetensors":
        raise ValueError(f"--format dcp writes a directory: give a directory path, not {out}")
    state, _ = checkpoint_state(path, log=log)
    export_dcp(state, out)
    return out


def load_exported(path: str | Path) -> tuple[GPT, str]:
    """Rebuild a GPT from a file written by :func:`export`; returns the model and the token kind."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if CONFIG_KEY not in meta:
        raise ValueError(f"{path} has no {CONFIG_KEY} metadata: it was not written by zerodp export")
    model = GPT(GPTConfig(**json.loads(meta[CONFIG_KEY])))
    model.load_state_dict(load_file(str(path)))
    return model, meta.get(KIND_KEY, "bytes")


def sample(path: str | Path, prompt: str = "\n", tokens: int = 200, temperature: float = 0.8,
           top_k: int | None = 40, seed: int = 0, log=print) -> str:
    """Text generated by the model in a checkpoint (or an exported file), continuing ``prompt``."""
    if tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {tokens}")
    p = Path(path)
    if p.is_file() and p.suffix == ".safetensors":
        model, kind = load_exported(p)
    else:
        model, ck = model_from_checkpoint(p, log=log)
        kind = ck.manifest.get("data", {}).get("kind", "bytes")
    model.eval()
    if kind == "bytes":
        ids = list(prompt.encode("utf-8")) or [10]
    else:
        try:
            ids = [int(t) for t in prompt.split()] or [0]
        except ValueError:
            raise ValueError("this model was trained on token ids, not bytes: give --prompt as "
                             "space-separated integers") from None
    idx = torch.tensor([ids], dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    outp = model.generate(idx, tokens, temperature=temperature, top_k=top_k, generator=g)
    return decode(outp[0].tolist(), kind)
