"""Exports that stream (docs/interop.md, guide §12.7): ``save_hf(engine, ...)`` writes unit by unit
from the shards, so no rank holds more than its shard plus one unit's full tensors, and what it
writes loads with ``from_pretrained`` and gives the engine's logits; ``zerodp export --format hf``
assembles one tensor at a time from the checkpoint's pieces.

The memory bound is measured, not assumed: each rank resets its peak resident set
(``/proc/self/clear_refs``, Linux) just before ``save_hf`` and reads it (``VmHWM``) after. A
52.5 M-parameter model (16 units of 3.3 M, 210 MB in fp32, built on the meta device so that each
rank only ever materializes its shard) at stage 3 on 2 ranks must stay within

    peak − resident before ≤ 3 × one unit's fp32 bytes + 32 MiB

- the unit's summation buffer (one, reused for every unit), the reduction's own scratch buffer
(gloo), one tensor's cast copy (bf16 here) — and 32 MiB of allocator slack (glibc arenas returning
memory late, page granularity, the safetensors header and Python objects). Measured here: +7 to
+20 MiB against the bound's 69.5 MiB. Gathering the whole model, as the export did before, took
+206 and +213 MiB on the two ranks: the 200 MiB of fp32 tensors on every rank.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from _engine_common import spawn_once

ROOT = Path(__file__).resolve().parents[1]
D, UNITS = 1280, 16
SLACK = 32 * 2**20  # allocator slack, see the module docstring


class Wide(nn.Module):
    """52.5 M parameters in 16 units of two 1280 × 1280 linear layers."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D))
                                     for _ in range(UNITS)])

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _ranks(rank: int, world: int, out: str) -> dict:
    import zerodp
    from zerodp.engine.hf import save_hf

    result: dict = {}
    # 1. A tied-embedding Llama from a config: the streamed export loads and gives the engine's logits.
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        result["llama"] = "skipped: no transformers"
    else:
        data = json.loads((ROOT / "examples" / "configs" / "check-llama" / "config.json").read_text())
        cfg = AutoConfig.for_model(data.pop("model_type"), **data)
        torch.manual_seed(0)
        llama = AutoModelForCausalLM.from_config(cfg)
        engine = zerodp.parallelize(llama, optimizer=lambda g: torch.optim.AdamW(g, lr=1e-2), stage=3,
                                    units=list(llama.model.layers))
        ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
        engine(input_ids=ids, labels=ids).loss.backward()
        engine.step()
        engine.zero_grad()
        engine.eval()
        with torch.no_grad():
            logits = engine(input_ids=ids).logits
        save_hf(engine, os.path.join(out, "llama"), config=cfg.to_dict(), max_shard_bytes=300_000)
        if rank == 0:
            loaded = AutoModelForCausalLM.from_pretrained(os.path.join(out, "llama")).eval()
            with torch.no_grad():
                theirs = loaded(input_ids=ids).logits
            torch.testing.assert_close(theirs, logits)  # fp32 on both sides: assert_close's fp32 tolerances
            result["llama"] = "ok"
    # 2. 52.5 M parameters at stage 3: the peak while exporting.
    with torch.device("meta"):
        wide = Wide()
    engine = zerodp.parallelize(wide, optimizer=lambda g: torch.optim.SGD(g, lr=0.1), stage=3,
                                units=list(wide.blocks))
    unit_bytes = 2 * (D * D + D) * 4
    resident = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM, the peak resident set, to the current one
    save_hf(engine, os.path.join(out, "wide"), dtype=torch.bfloat16, max_shard_bytes=40 * 2**20)
    result.update(peak=_status("VmHWM"), resident=resident, unit_bytes=unit_bytes,
                  params=sum(p.numel() for p in Wide().parameters()) if rank == 0 else None)
    return result


@pytest.mark.dist
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="measures the peak RSS through Linux's /proc")
def test_save_hf_streams_from_the_shards_and_what_it_writes_loads_with_the_engines_logits(tmp_path):
    results = spawn_once(_ranks, 2, str(tmp_path), timeout=420)
    assert results[0]["llama"] in ("ok", "skipped: no transformers")
    assert results[0]["params"] >= 50_000_000
    for rank, r in enumerate(results):
        grew = r["peak"] - r["resident"]
        bound = 3 * r["unit_bytes"] + SLACK
        print(f"rank {rank}: resident {r['resident'] / 2**20:.0f} MiB before save_hf, peak +{grew / 2**20:.1f} MiB "
              f"while saving (bound {bound / 2**20:.1f} MiB; the whole model is {r['unit_bytes'] * UNITS / 2**20:.0f} "
              "MiB in fp32)")
        assert grew <= bound, (rank, grew, bound)
    from zerodp.engine.hf import load_hf_state_dict

    saved = load_hf_state_dict(tmp_path / "wide")
    assert len(saved) == 4 * UNITS and all(t.dtype == torch.bfloat16 for t in saved.values())
    index = json.loads((tmp_path / "wide" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded across files


def test_write_hf_holds_one_source_tensor_at_a_time(tmp_path):
    """What ``zerodp export --format hf`` writes through (``checkpoint_sources`` → ``write_hf``): each
    :class:`TensorSource` is loaded when its turn comes and dropped before the next is loaded."""
    import gc
    import weakref

    from zerodp.engine.hf import TensorSource, load_hf_state_dict, write_hf

    live: set[int] = set()
    most = [0]

    def loader(i: int):
        def load():
            gc.collect()
            t = torch.full((64, 33), float(i))
            live.add(i)
            weakref.finalize(t, live.discard, i)
            most[0] = max(most[0], len(live))
            return t
        return load

    sources = {f"w{i}": TensorSource((64, 33), torch.float32, loader(i)) for i in range(12)}
    sources["tied"] = sources["w3"]  # one tensor under two names is written once, as save_pretrained does
    sources["w5_t"] = sources["w5"].map(lambda t: t.t().contiguous(), (33, 64))
    write_hf(sources, tmp_path / "hf", dtype=torch.bfloat16, max_shard_bytes=20_000)
    assert most[0] == 1
    back = load_hf_state_dict(tmp_path / "hf")
    assert sorted(back) == sorted([f"w{i}" for i in range(12)] + ["w5_t"])
    assert back["w5_t"].shape == (33, 64) and bool((back["w7"] == 7).all()) and back["w7"].dtype == torch.bfloat16
