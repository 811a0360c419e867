"""Each complaint a new user had about the planner's command line, with what it does now.

Expected figures are published ones (model cards and papers), not the planner's own output.
"""

import argparse
import json
import time
from pathlib import Path

import pytest

from zerodp.cli import build_parser, main

DATA = Path(__file__).resolve().parent / "data"
ROOT = Path(__file__).resolve().parents[1]

# published totals: Llama 3 Herd of Models (8.03B); Qwen2-7B model page (7.62B); Mixtral of
# Experts (46.7B total, 12.9B active); DeepSeek-V3 Technical Report (671B total, 37B active)
PUBLISHED = {"llama-3-8b": (8.03e9, None), "qwen2-7b": (7.62e9, None),
             "mixtral-8x7b": (46.7e9, 12.9e9), "deepseek-v3": (671e9, 37e9)}


def run(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's errors and -h exit as argparse does
        code = exc.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_config_json_gives_the_published_parameter_count(capsys, name):
    total, active = PUBLISHED[name]
    for path in (DATA / name / "config.json", DATA / name):  # the file, or its directory
        code, out, err = run(capsys, "plan", "memory", "--config", str(path), "--gpus", "8", "--json")
        assert code == 0, err
        model = json.loads(out)["model"]
        assert model["params"] == pytest.approx(total, rel=0.005)
    with capsys.disabled():
        print(f"\n{name}: {model['params']:,.0f} parameters, published {total:,.0f} "
              f"({100 * (model['params'] / total - 1):+.3f}%)")
        if active:
            assert model["active"] == pytest.approx(active, rel=0.03)


def test_config_on_roofline_and_simulate(capsys):
    code, out, _ = run(capsys, "plan", "roofline", "--config", str(DATA / "deepseek-v3"), "--json")
    assert code == 0 and json.loads(out)["threshold"]["moe_factor"] == 32  # 256 experts, top 8
    code, out, _ = run(capsys, "plan", "simulate", "--config", str(DATA / "qwen2-7b"), "--json")
    t = json.loads(out)["timeline"]
    assert code == 0 and t["total_bytes"] == pytest.approx(2 * 7.62e9, rel=0.005)  # bf16 grads
    code, _, err = run(capsys, "plan", "memory", "--config", str(DATA / "nowhere"))
    assert code == 2 and "no such file" in err and err.count("\n") == 1


def test_gqa_and_swiglu_are_modelled():
    from zerodp import plan
    llama = plan.get_model("llama3-8b")
    assert (llama.kv_heads, llama.gated_mlp) == (8, True)
    mha = plan.custom_model(layers=32, hidden=4096, heads=32, kv_heads=32, ffn=14336, vocab=128256)
    # 8 of 32 key/value heads: k and v projections are a quarter as large (2·h·(h − h/4) fewer)
    assert mha.params - llama.params == pytest.approx(32 * 2 * 4096 * (4096 - 1024))
    a_gqa = plan.memory_plan(llama, 8, "H100", seq=4096).activations["per_layer_bytes"]
    a_mha = plan.memory_plan(mha, 8, "H100", seq=4096).activations["per_layer_bytes"]
    assert a_gqa < a_mha  # smaller K and V are stored


def test_params_without_shape_warns_and_counts_gathered_units(capsys):
    code, out, _ = run(capsys, "plan", "memory", "--params", "1T", "--gpus", "1024")
    assert code == 0
    assert "Ψ = 1.0T" in out and "1e+03B" not in out
    assert "assume" in out and "layers" in out  # says the units rest on an assumed shape
    code, out, _ = run(capsys, "plan", "memory", "--params", "1T", "--gpus", "1024", "--json")
    z3 = json.loads(out)["stages"][3]
    assert z3["gathered_unit_bytes"] > 1e9 and json.loads(out)["warnings"]


@pytest.mark.parametrize("argv", [
    ["plan", "simulate", "--bucket", "1B"],
    ["plan", "simulate", "--bucket", "100"],
])
def test_simulation_work_is_bounded(capsys, argv):
    start = time.process_time()  # CPU time: other work on the machine does not count
    code, out, err = run(capsys, *argv)
    assert time.process_time() - start < 1
    assert code == 2 and "buckets" in err and "at least" in err and err.count("\n") == 1


def test_a_malformed_config_is_named_by_its_path(capsys, tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text('{"hidden_size": 12,')
    empty = tmp_path / "y.json"
    empty.write_text('{"a": 1}')
    for argv, needle in ((["plan", "memory", "--config", str(bad)], f"--config {bad} is not valid JSON"),
                         (["plan", "recommend", "--config", str(empty)], f"--config {empty} has no hidden_size"),
                         (["plan", "comm", "--config", str(bad)], f"--config {bad} is not valid JSON")):
        code, out, err = run(capsys, *argv)
        assert code == 2 and needle in err and err.count("\n") == 1, err


@pytest.mark.parametrize("argv, needle", [
    (["plan", "memory", "--gpus", "1e30"], "--gpus: gpus must be between 1 and 1,000,000"),
    (["plan", "batch", "--global-batch-tokens", "1e30", "--seq-len", "4096", "--micro-batch", "1",
      "--gpus", "8"], "--global-batch-tokens: global-batch-tokens must be between 1 and"),
    (["plan", "batch", "--tokens", "1e30"], "--tokens: global-batch-tokens must be between 1 and"),
    (["plan", "batch", "--tokens", "1e15", "--seq", "1", "--mbs", "1", "--gpus", "1"],
     "grad_acc"),
    (["plan", "memory", "--seq-len", "0"], "--seq-len: seq-len must be between 1"),
    (["plan", "memory", "--model", "llama3-8b", "--micro-batch", "4"], "give seq (--seq-len) too"),
    (["plan", "memory", "--model", "llama3-8b", "--recompute", "full"], "give seq (--seq-len) too"),
    (["plan", "memory", "--model", "llama3-8b", "--attention", "eager"], "give seq (--seq-len) too"),
    (["plan", "memory", "--attention", "paged"], "--attention: invalid choice: 'paged'"),
    (["plan", "memory", "--seq", "4096"], "activations need the model's shape"),
    (["plan", "memory", "--bytes-per-param", "0"], "--bytes-per-param: bytes-per-param must be"),
    (["plan", "roofline", "--global-batch-tokens", "0"],
     "--global-batch-tokens: global-batch-tokens must be"),
    (["plan", "report", "--hardware", "B200"], "unrecognized arguments: --hardware B200"),
    (["plan", "batch", "--hardware", "B200", "--tokens", "4M", "--seq", "4096", "--mbs", "1",
      "--gpus", "8"], "unrecognized arguments: --hardware B200"),
    (["plan", "memory", "--params", "-7e9"], "--params: params must be between 1"),
    (["plan", "memory", "--model", "llama3-8b", "--layers", "4"], "drop --layers"),
    (["plan", "memory", "--precision", "fp32", "--fp32-grad-acc"], "already accumulate in fp32"),
    (["plan", "simulate", "--fsdp", "--bucket-mb", "50"], "--bucket-mb does not apply to --fsdp"),
    (["plan", "simulate", "--fsdp", "--bucket", "25MB"], "--bucket-mb does not apply to --fsdp"),
    (["plan", "simulate", "--no-prefetch"], "--no-prefetch only applies with --fsdp"),
    (["plan", "roofline", "--model", "deepseek-v3", "--experts", "8"], "drop --experts/--top-k"),
    (["plan", "roofline", "--axes", "4"], "--axes: axes must be between 1 and 3"),
    (["sample", "ckpt", "--top-k", "0"], "--top-k: top-k must be >= 1"),
    (["sample", "ckpt", "--top-k", "-3"], "--top-k: top-k must be >= 1"),
    (["sample", "ckpt", "--temperature", "-1"], "--temperature: temperature must be > 0"),
    (["predict", "--model", "llama3-8b"], "llama3-8b is a planner-only model"),
    (["train", "--preset", "llama3-70b"], "llama3-70b is a planner-only model"),
    (["train", "--nproc"], "argument --nproc: expected one argument"),
])
def test_nonsense_gets_one_line_and_status_2(capsys, argv, needle):
    code, out, err = run(capsys, *argv)
    assert code == 2, (out, err)
    assert needle in err, err
    assert err.count("\n") == 1 and "usage:" not in err and "Traceback" not in err, err
    assert out == ""


def test_help_shows_the_usage_block_and_defaults(capsys):
    code, out, _ = run(capsys, "plan", "memory", "-h")
    assert code == 0 and out.startswith("usage:")
    assert "(default: 64)" in out and "(default: bf16)" in out


def _actions(parser, prog="zerodp"):
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                yield from _actions(sub, f"{prog} {name}")
        elif not isinstance(a, argparse._HelpAction):
            yield prog, parser, a


def test_every_option_has_help_and_shows_its_default():
    missing, no_default = [], []
    for prog, parser, a in _actions(build_parser()):
        if not a.help:
            missing.append(f"{prog} {a.option_strings or a.dest}")
            continue
        shown = parser.formatter_class(prog)._get_help_string(a) if hasattr(
            parser.formatter_class(prog), "_get_help_string") else a.help
        if a.default not in (None, False, True, argparse.SUPPRESS) and "default" not in shown:
            no_default.append(f"{prog} {a.option_strings}")
    assert missing == [] and no_default == [], (missing, no_default)
    text = build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    assert "(default: True)" not in text


def test_people_numbers(capsys):
    _, out, _ = run(capsys, "plan", "comm", "--bytes", "1GB", "--gpus", "1")
    assert "on 1 rank " in out and "1 ranks" not in out
    _, out, _ = run(capsys, "plan", "memory", "--params", "8B", "--gpus", "1")
    assert "Ψ = 8.0B" in out and "N = 1 GPU," in out


def test_planner_and_trainer_models_are_one_list():
    torch = pytest.importorskip("torch", reason="the trainer's models need torch (zerodp[train])")
    from zerodp import plan
    from zerodp.train.config import PRESET_NAMES
    from zerodp.train.model import GPT, PRESETS

    assert set(plan.model_names(trainable=True)) == set(PRESETS) == set(PRESET_NAMES)
    assert set(plan.model_names()) == set(plan.model_names(True)) | set(plan.model_names(False))
    for name, cfg in PRESETS.items():  # the planner counts exactly what the trainer builds
        with torch.device("meta"):
            built = GPT(cfg).num_params()
        assert plan.get_model(name).params == built, name



def test_tied_embeddings_count_once():
    # Llama 3.2 1B (its config.json: tie_word_embeddings true; model card: 1.24B parameters)
    from zerodp import plan
    cfg = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
           "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
           "vocab_size": 128256, "tie_word_embeddings": True}
    tied = plan.model_from_config(cfg)
    assert tied.params == pytest.approx(1.24e9, rel=0.005)
    untied = plan.model_from_config(dict(cfg, tie_word_embeddings=False))
    assert untied.params - tied.params == 128256 * 2048
