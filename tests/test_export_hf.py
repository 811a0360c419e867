"""`zerodp export`: a Hugging Face directory that transformers loads and that gives the GPT's
logits, and exports whose bytes depend only on the checkpoint."""

import hashlib
import json
from pathlib import Path

import pytest
import torch

from zerodp.cli import main
from zerodp.train import checkpoint as ckpt
from zerodp.train.model import GPT, GPTConfig, PRESETS


def _checkpoint(root: Path, cfg: GPTConfig, seed: int = 3) -> GPT:
    """A world-1 checkpoint of a freshly initialised GPT whose biases and LayerNorm weights are
    random too (zeros and ones would hide a bias or a LayerNorm that is mapped to the wrong name)."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    pieces = [type("P", (), dict(name=n, kind="param", start=0, stop=p.numel(), shape=tuple(p.shape),
                                 tensor=p.detach().reshape(-1)))
              for n, p in model.named_parameters()]
    ckpt.save(pieces, root / "checkpoints", 5, {"model": cfg.to_dict(), "stage": 0,
                                                "scalars": {"kinds": [], "groups": [{}]}, "data": {"kind": "bytes"}})
    return model.eval()


@pytest.mark.parametrize("cfg", [PRESETS["nano"], GPTConfig(seq_len=32, n_layer=2, n_head=4, d_model=64, ffn_mult=3,
                                                            bias=False, tie_weights=True)],
                         ids=["nano", "no-bias-tied"])
def test_hf_export_loads_with_from_pretrained_and_gives_the_same_logits(tmp_path, capsys, cfg):
    transformers = pytest.importorskip("transformers")
    model = _checkpoint(tmp_path / "run", cfg)
    out = tmp_path / "hf"
    assert main(["export", str(tmp_path / "run"), str(out), "--format", "hf"]) == 0
    assert {"config.json", "generation_config.json", "model.safetensors.index.json"} <= {p.name for p in out.iterdir()}
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(hf).__name__ == "GPT2LMHeadModel"
    assert sum(p.numel() for p in hf.parameters()) >= model.num_params()
    gen = transformers.GenerationConfig.from_pretrained(out)
    assert gen.do_sample and gen.top_k == 40
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(x), hf(x).logits
    # the same function; only the order of float32 operations differs (eager attention vs SDPA)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    assert (theirs - ours).abs().max() < 1e-3 * ours.abs().max()
    # and not a near miss: a model with another seed is far away
    other = _checkpoint(tmp_path / "other", cfg, seed=4)
    with torch.no_grad():
        assert (other(x) - theirs).abs().max() > 100 * (theirs - ours).abs().max()


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_two_exports_of_one_checkpoint_are_identical_bytes(tmp_path):
    _checkpoint(tmp_path / "run", PRESETS["nano"])
    # safetensors orders the metadata by a hash map seeded per map, so plain save_file differs from
    # one call to the next within one process too (three keys: 6 orders): five exports, one hash
    names = "abcde"
    for name in names:
        assert main(["export", str(tmp_path / "run"), str(tmp_path / f"{name}.safetensors")]) == 0
    assert len({_sha(tmp_path / f"{n}.safetensors") for n in names}) == 1
    a = tmp_path / "a.safetensors"
    from safetensors import safe_open

    from zerodp.train.export import CONFIG_KEY, load_exported

    with safe_open(str(a), framework="pt") as f:  # still a safetensors file safetensors reads
        assert json.loads(f.metadata()[CONFIG_KEY]) == PRESETS["nano"].to_dict()
    reloaded, _ = load_exported(a)
    model = _checkpoint(tmp_path / "again", PRESETS["nano"])
    for n, p in model.named_parameters():
        assert torch.equal(dict(reloaded.named_parameters())[n], p), n
    for name in ("a", "b"):  # the Hugging Face directory too, shards, index and configs
        assert main(["export", str(tmp_path / "run"), str(tmp_path / f"hf-{name}"), "--format", "hf",
                     "--max-shard-mb", "0.05"]) == 0
    files = sorted(p.name for p in (tmp_path / "hf-a").iterdir())
    assert len(files) > 4 and files == sorted(p.name for p in (tmp_path / "hf-b").iterdir())
    for f in files:
        assert _sha(tmp_path / "hf-a" / f) == _sha(tmp_path / "hf-b" / f), f


def test_the_header_rewrite_is_what_safetensors_reads():
    from safetensors.torch import load

    from zerodp.train.export import safetensors_bytes

    tensors = {"b": torch.arange(3, dtype=torch.float32), "a": torch.ones(2, 5, dtype=torch.bfloat16),
               "c": torch.tensor([7], dtype=torch.int64)}
    data = safetensors_bytes(tensors, {"z": "1", "a": "2", "m": "3"})
    n = int.from_bytes(data[:8], "little")
    assert n % 8 == 0 and list(json.loads(data[8:8 + n])["__metadata__"]) == ["a", "m", "z"]
    back = load(data)
    assert set(back) == set(tensors) and all(torch.equal(back[k], v) for k, v in tensors.items())
