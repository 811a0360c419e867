"""Choosing FSDP units (guide §10.3), single process: which parameters each unit owns, and the
clear refusals (weights tied across units, mixed dtypes, modules outside the model)."""

import pytest
import torch.nn as nn

from zerodp.engine.unit import FROZEN, default_unit_modules, plan_units
from zerodp.train.model import GPT, GPTConfig

CFG = GPTConfig(vocab_size=11, seq_len=8, n_layer=3, n_head=2, d_model=8)


def _names(spec):
    return [f for f, _, _ in spec.params]


def test_default_units_are_the_blocks_plus_a_root_for_the_rest():
    m = GPT(CFG)
    specs = plan_units(m, None, lambda n, p: 0)
    assert [s.label for s in specs] == ["root", "blocks.0", "blocks.1", "blocks.2"]
    assert [s.module for s in specs[1:]] == list(m.blocks)
    root = set(_names(specs[0]))
    assert root == {"tok_emb.weight", "pos_emb.weight", "ln_f.weight", "ln_f.bias", "head.weight"}
    # Every parameter is owned by exactly one unit.
    owned = [f for s in specs for f in _names(s)]
    assert sorted(owned) == sorted(n for n, _ in m.named_parameters())
    assert all(f.startswith("blocks.1.") for f in _names(specs[2]))


def test_largest_module_list_wins_and_no_list_means_one_root_unit():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.small = nn.ModuleList([nn.Linear(2, 2) for _ in range(4)])
            self.big = nn.ModuleList([nn.Linear(16, 16) for _ in range(2)])

    m = Two()
    assert default_unit_modules(m) == list(m.big)
    flat = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 2))
    specs = plan_units(flat, None, lambda n, p: 0)
    assert len(specs) == 1 and specs[0].label == "root" and len(specs[0].params) == 4


def test_units_override_whole_model_and_nested_units():
    m = GPT(CFG)
    whole = plan_units(m, [m], lambda n, p: 0)
    assert len(whole) == 1 and whole[0].module is m and len(whole[0].params) == len(list(m.parameters()))
    nested = plan_units(m, [m.blocks[0], m.blocks[0].mlp], lambda n, p: 0)
    labels = {s.label: set(_names(s)) for s in nested}
    assert labels["blocks.0.mlp"] == {n for n, _ in m.named_parameters() if n.startswith("blocks.0.mlp.")}
    assert not labels["blocks.0"] & labels["blocks.0.mlp"]  # innermost unit owns a parameter


def test_groups_are_contiguous_and_frozen_last():
    m = GPT(CFG)
    m.blocks[0].ln1.weight.requires_grad_(False)
    specs = plan_units(m, None, lambda n, p: 1 if p.dim() < 2 else 0)
    for s in specs:
        groups = [g for _, _, g in s.params]
        assert groups == sorted(groups, key=lambda g: (g == FROZEN, g))
    assert ("blocks.0.ln1.weight", m.blocks[0].ln1.weight, FROZEN) in specs[1].params


def test_tied_weights_in_one_unit_work_across_units_are_refused():
    m = GPT(GPTConfig(**{**CFG.to_dict(), "tie_weights": True}))
    specs = plan_units(m, None, lambda n, p: 0)
    assert "tok_emb.weight" in _names(specs[0]) and "head.weight" not in _names(specs[0])
    with pytest.raises(ValueError, match=r"tok_emb.weight.*head.weight.*different FSDP units.*same unit"):
        plan_units(m, [m.tok_emb, *m.blocks], lambda n, p: 0)


def test_bad_units_are_refused_with_a_reason():
    m = GPT(CFG)
    with pytest.raises(ValueError, match="not a submodule"):
        plan_units(m, [nn.Linear(2, 2)], lambda n, p: 0)
    with pytest.raises(ValueError, match="listed twice"):
        plan_units(m, [m.blocks[0], m.blocks[0]], lambda n, p: 0)
    b = m.blocks[0]
    with pytest.raises(ValueError, match="'blocks.0' owns no parameters"):
        plan_units(m, [b, b.ln1, b.ln2, b.attn, b.mlp], lambda n, p: 0)  # all nested away
    with pytest.raises(TypeError, match="nn.Module"):
        plan_units(m, ["blocks.0"], lambda n, p: 0)
    m.blocks[1].double()
    with pytest.raises(ValueError, match="mixes parameter dtypes"):
        plan_units(m, [m.blocks[0]], lambda n, p: 0)
