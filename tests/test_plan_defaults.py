"""One source for every default (zerodp.plan.defaults): every parameter of every question of the
JSON API (/api/schema, whose defaults the page takes as its starting values) against the option of
``zerodp plan`` that asks the same, and both against zerodp.plan.defaults.DEFAULTS. A parameter
with no CLI option is listed with the reason; a CLI default that stands for a value ("the
hardware's") is compared with that value."""

import argparse
import re
from pathlib import Path

import pytest

from zerodp.cli import build_parser
from zerodp.plan import get_hardware
from zerodp.plan.defaults import DEFAULTS
from zerodp.ui.api import Api

STATIC = Path(__file__).resolve().parents[1] / "src" / "zerodp" / "ui" / "static"

#: API question -> the ``zerodp plan`` subcommand that answers it
COMMAND = {"memory": "memory", "overlap": "simulate", "roofline": "roofline", "batch": "batch",
           "recommend": "recommend"}
#: API name -> the CLI option's dest, where they differ
DEST = {
    "memory": {"n": "gpus", "micro_batch": "mbs", "tied": "tied_embeddings"},
    "overlap": {"n": "gpus", "bucket_bytes": "bucket_mb"},
    "roofline": {"n": "gpus", "experts_per_token": "top_k", "batch_tokens": "global_batch_tokens"},
    "batch": {"target_tokens": "global_batch_tokens", "micro_batch": "mbs", "dp": "gpus"},
    "recommend": {},
}
#: API parameters no CLI option mirrors, and why
NO_CLI = {
    ("memory", "config"): "the page's pasted config.json (the CLI's --config is a path)",
    ("memory", "params"): "a shape: absent by default on both",
    ("recommend", "config"): "the page's pasted config.json (the CLI's --config is a path)",
    ("overlap", "latency"): "the hardware's, compared below",
    ("overlap", "bandwidth"): "the hardware's, compared below",
    ("overlap", "collective"): "the page can draw ReduceScatter; zerodp plan simulate runs the "
                               "default all_reduce (checked below)",
}
#: options whose absent value (None) stands for a number the help states: (question, name) ->
#: (value, the words of the option's help that say it)
NONE_MEANS = {
    ("roofline", "experts"): (1, "default 1"),
    ("roofline", "experts_per_token"): (1, "default 1"),
    ("recommend", "nodes"): (1, "default 1"),
}
#: the model when none is named: the command's JSON names it (compared below)
MODEL_JSON = {"memory": ("memory", lambda d: d["model"]["name"]),
              "overlap": ("simulate", lambda d: d["model"]),
              "recommend": ("recommend", lambda d: d["model"])}
SHAPE = {"layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "experts", "experts_per_token",
         "shared_experts"}


def _subparser(parser, *path):
    for name in path:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


def _cli_defaults(command: str) -> dict:
    p = _subparser(build_parser(), "plan", command)
    return {a.dest: a.default for a in p._actions
            if a.default is not argparse.SUPPRESS and a.help is not argparse.SUPPRESS}


def _questions():
    schema = Api().schema()
    for question, command in COMMAND.items():
        for param in schema[question]["params"]:
            yield question, command, param


@pytest.mark.parametrize("question, command, param",
                         [pytest.param(*q, id=f"{q[0]}.{q[2]['name']}") for q in _questions()])
def test_api_cli_and_defaults_agree(question, command, param):
    name, api_default = param["name"], param["default"]
    if (question, name) in NO_CLI or name == "model":
        return
    if question == "memory" and name in SHAPE:  # a custom model's shape: absent on both
        assert api_default is None and _cli_defaults(command)[DEST[question].get(name, name)
                                                               .replace("experts_per_token",
                                                                        "top_k")] is None
        return
    cli = _cli_defaults(command)
    dest = DEST[question].get(name, name)
    assert dest in cli, f"{question}.{name}: no visible option of zerodp plan {command} sets {dest}"
    cli_default = cli[dest]
    if question == "overlap" and name == "bucket_bytes":  # MiB on the command line
        cli_default *= 2**20
    if (question, name) in NONE_MEANS and cli_default is None:
        cli_default, words = NONE_MEANS[question, name]
        action = next(a for a in _subparser(build_parser(), "plan", command)._actions
                      if a.dest == dest and a.help is not argparse.SUPPRESS)
        assert words in action.help, action.help
    if isinstance(api_default, float) or isinstance(cli_default, float):
        assert float(cli_default) == float(api_default), (question, name, cli_default, api_default)
    else:
        assert cli_default == api_default, (question, name, cli_default, api_default)
    assert DEFAULTS[question][name] == api_default or (
        question == "model"), (question, name, DEFAULTS[question][name], api_default)


@pytest.mark.parametrize("question", sorted(MODEL_JSON))
def test_the_model_when_none_is_named(question, capsys):
    import json

    from zerodp.cli import main

    command, name_of = MODEL_JSON[question]
    assert main(["plan", command, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    api = {p["name"]: p["default"] for p in Api().schema()[question]["params"]}
    assert name_of(d) == api["model"] == DEFAULTS[question]["model"]


def test_simulate_runs_the_default_collective(capsys):
    import json

    from zerodp.cli import main

    assert main(["plan", "simulate", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["timeline"]["collective"] == \
        DEFAULTS["overlap"]["collective"]


def test_every_default_is_a_parameter_of_the_api():
    """No default in zerodp.plan.defaults that the API does not serve (a stale entry)."""
    schema = Api().schema()
    for question, values in DEFAULTS.items():
        names = {p["name"] for p in schema[question]["params"]}
        assert set(values) <= names, (question, set(values) - names)


def test_the_hardware_dependent_defaults_are_the_hardwares():
    hw = get_hardware(DEFAULTS["overlap"]["hardware"])
    params = {p["name"]: p["default"] for p in Api().schema()["overlap"]["params"]}
    assert params["latency"] == hw.small_message_latency and params["bandwidth"] == hw.intra_bw
    assert DEFAULTS["overlap"]["latency"] is None and DEFAULTS["overlap"]["bandwidth"] is None


def test_the_page_takes_its_starting_values_from_the_schema():
    """index.html's controls carry no value of their own: app.js sets each from /api/schema."""
    html = (STATIC / "index.html").read_text()
    controls = re.findall(r"<(?:input|select)\b[^>]*>", html)
    assert controls and not [c for c in controls if re.search(r"\bvalue=", c)
                              and "type=\"file\"" not in c], "a control with its own value"
    assert "this.set(p.name, p.default)" in (STATIC / "app.js").read_text()


def test_memory_defaults_give_one_verdict():
    """The issue's case: Llama 3 8B, 8 GPUs, seq 4096: the CLI and the API agree (flash attention,
    no recomputation: 69.4 / 55.4 / 44.3 GB at stages 1-3)."""
    import contextlib
    import io
    import json

    from zerodp.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", "memory", "--json", "--model", "llama3-8b", "--gpus", "8",
                     "--seq-len", "4096"]) == 0
    cli = [s["total_bytes"] for s in json.loads(out.getvalue())["stages"]]
    api = [s["total_bytes"] for s in Api().handle("memory", {"model": "llama3-8b", "n": "8",
                                                             "seq": "4096"})["stages"]]
    assert cli == api
    assert [round(b / 1e9, 1) for b in cli[1:]] == [73.6, 59.6, 48.5]
