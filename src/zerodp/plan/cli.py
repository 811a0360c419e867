"""``zerodp plan memory|comm|roofline|batch|simulate|recommend|report``: the planner on the command line.

Every subcommand prints a table with units, or with ``--json`` the result's ``to_dict()``, and
accepts ``--hardware NAME_OR_FILE`` (a preset or a TOML/JSON hardware file).
"""

from __future__ import annotations

import argparse
import json

from zerodp.plan._common import (GB, fmt_bytes, fmt_count, fmt_time, parse_quantity, plural,
                                 range_sentence, table)
from zerodp.plan.batch import plan_batch
from zerodp.plan.defaults import ATTENTION, DEFAULTS
from zerodp.plan.collectives import KINDS, RingCost, collective_time, network_cost
from zerodp.plan.hardware import get_hardware, hardware_names
from zerodp.plan.hf import load_config
from zerodp.plan.hybrid import COMPRESSION_ABOUT, COMPRESSIONS, QUANT_BLOCK, step_comm
from zerodp.plan.ownership import OPTIMIZERS, PER_TENSOR
from zerodp.plan.memory import (MAX_GPUS, MAX_K, MAX_MICRO_BATCH, MAX_PARAMS, MAX_SEQ, PRECISIONS,
                                RECOMPUTE, max_params, memory_plan)
from zerodp.plan.models import custom_model, get_model, model_names
from zerodp.plan.report import build_report
from zerodp.plan.roofline import labels as roofline_labels
from zerodp.plan.roofline import max_devices, threshold
from zerodp.plan.timeline import (MAX_BUCKETS, model_layers,
                                  simulate_backward, simulate_fsdp, sweep_buckets)

DEFAULT_HARDWARE = DEFAULTS["memory"]["hardware"]
MEM, SIM, ROOF, BATCH, REC = (DEFAULTS[q] for q in ("memory", "overlap", "roofline", "batch",
                                                   "recommend"))


def _qty(what, low=None, high=None, why="", count=False, integer=False, allow_zero=False):
    """An argparse type: a number with optional suffixes (16e9, 25MB, 4M, 8B for counts) within
    [low, high]; out of range, one sentence with the range and why."""
    def parse(text):
        try:
            v = parse_quantity(text, what, count=count)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if v != v or v in (float("inf"), float("-inf")):
            raise argparse.ArgumentTypeError(f"{what} must be a finite number, got {text!r}")
        if integer and not float(v).is_integer():
            raise argparse.ArgumentTypeError(f"{what} must be a whole number, got {text!r}")
        lo = low if low is not None else 0
        if v < lo or (v == 0 and not allow_zero and lo == 0) or (high is not None and v > high):
            raise argparse.ArgumentTypeError(range_sentence(
                what, lo, high, why, text, low_open=lo == 0 and not allow_zero))
        return int(v) if integer else v
    parse.__name__ = what
    return parse


def _int_qty(what, low=1, high=None, why="", count=True):
    return _qty(what, low, high, why, count=count, integer=True, allow_zero=low == 0)


_GPUS = dict(high=MAX_GPUS, why="no cluster holds more than a million")
_SHAPE = (("layers", 100_000), ("hidden", 1_000_000), ("heads", 100_000), ("kv-heads", 100_000),
          ("ffn", 10_000_000), ("vocab", 100_000_000), ("shared-experts", 100_000))


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every option's default, except for switches and options whose help says what an
    absent value means."""

    def _get_help_string(self, action):
        if action.default is None or isinstance(action.default, bool) or action.help is None \
                or "default" in action.help:
            return action.help
        return super()._get_help_string(action)


def _common(p, model=False, hardware=True):
    if hardware:
        p.add_argument("--hardware", default=DEFAULT_HARDWARE, metavar="NAME_OR_FILE",
                       help=f"preset ({', '.join(hardware_names())}) or a .toml/.json hardware file")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    if model:
        g = p.add_argument_group("model: a preset, a config.json, or a parameter count and/or shape")
        g.add_argument("--model", metavar="NAME", help=f"a preset: {', '.join(model_names())}")
        g.add_argument("--config", metavar="PATH",
                       help="a Hugging Face config.json (or a model directory holding one): "
                            "Llama/Mistral/Qwen, Mixtral, DeepSeek, GPT-2")
        g.add_argument("--params", type=_qty("params", 1, MAX_PARAMS, "a thousand trillion at most",
                                             count=True),
                       help="parameter count, e.g. 8e9, 70B or 1T (default: from the model)")
        helps = {"layers": "transformer blocks L", "hidden": "hidden size h",
                 "heads": "attention heads a", "kv-heads": "key/value heads (grouped-query "
                 "attention; default: heads)", "ffn": "MLP width; given: a SwiGLU MLP (default: "
                 "a 4h GELU MLP)", "vocab": "vocabulary size", "shared-experts":
                 "MoE: experts every token runs (default 0)"}
        for name, high in _SHAPE:
            g.add_argument(f"--{name}", type=_int_qty(name, 0 if name == "shared-experts" else 1,
                                                      high), help=helps[name])
        g.add_argument("--experts", type=_int_qty("experts", 1, 100_000),
                       help="MoE: routed experts E (default 1: dense)")
        g.add_argument("--top-k", type=_int_qty("top-k", 1, 100_000),
                       help="MoE: experts per token k (default 1)")
        g.add_argument("--tied-embeddings", action="store_true",
                       help="input embedding and output head share one matrix")


_SHAPE_ARGS = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "shared_experts",
               "experts", "top_k")


def _model(args, default=None):
    shape = {k: getattr(args, k, None) for k in _SHAPE_ARGS}
    given = [f"--{k.replace('_', '-')}" for k, v in shape.items() if v is not None]
    if getattr(args, "tied_embeddings", False):
        given.append("--tied-embeddings")
    sources = [f for f, v in (("--model", args.model), ("--config", getattr(args, "config", None)))
               if v is not None]
    if len(sources) > 1:
        raise ValueError("give --model or --config, not both")
    if sources and (given or args.params is not None):
        extra = given[0] if given else "--params"
        raise ValueError(f"{sources[0]} fixes the model's shape and size; drop {extra}, or drop "
                         f"{sources[0]} and describe the model with --params/--layers/--hidden/...")
    if getattr(args, "config", None) is not None:
        return load_config(args.config)
    if args.params is not None or given:
        return custom_model(params=args.params, layers=shape["layers"], hidden=shape["hidden"],
                            heads=shape["heads"], ffn=shape["ffn"], vocab=shape["vocab"],
                            experts=shape["experts"] or 1, experts_per_token=shape["top_k"] or 1,
                            kv_heads=shape["kv_heads"], shared_experts=shape["shared_experts"] or 0,
                            tied_embeddings=args.tied_embeddings)
    name = args.model or default
    if name is None:
        raise ValueError(f"give --model ({', '.join(model_names())}), --config or --params")
    return get_model(name)


NODE = "node"


def _alias(p, canonical, old, **kw):
    """``canonical`` (shown) and ``old`` (a hidden alias kept for a release), one ``dest``."""
    p.add_argument(canonical, **kw)
    hidden = {k: v for k, v in kw.items() if k not in ("help", "default", "required")}
    p.add_argument(old, help=argparse.SUPPRESS, default=argparse.SUPPRESS, **hidden)


def _cluster_options(p, gpus_default=None):
    """--nodes, --gpus-per-node and --gpus (their product), as ``zerodp train`` names them."""
    g = p.add_argument_group("cluster")
    g.add_argument("--nodes", type=_int_qty("nodes", 1, **_GPUS),
                   help=f"nodes (default {REC['nodes']}, or --gpus / --nproc)")
    _alias(g, "--nproc", "--gpus-per-node", dest="gpus_per_node",
           type=_int_qty("nproc", 1, 100_000), default=REC["gpus_per_node"],
           help="GPUs (ranks) per node, as zerodp train --nproc (default: the hardware's, 8 on "
                "H100)")
    _gpus(g, gpus_default, "GPUs in all (default: nodes x GPUs per node)")


def _shard_size_type(text):
    """``--shard-size``: a whole number >= 1, or "node" (the GPUs per node of --hardware)."""
    if str(text).strip().lower() == NODE:
        return NODE
    return _int_qty("shard-size", 1, MAX_GPUS, "no cluster holds more than a million")(text)


def _shard_size(args, hw, n):
    """The shard-group size g: None (flat), or the number given; "node" → GPUs per node (at most n)."""
    g = getattr(args, "shard_size", None)
    if g == NODE:
        g = hw.devices_per_node if n is None else min(hw.devices_per_node, n)
    return g


def _levers(p, block=True):
    """--shard-size and --compress (guide §14)."""
    g = p.add_argument_group("past one node (guide §14)")
    g.add_argument("--shard-size", type=_shard_size_type, nargs="?", const=NODE, metavar="G",
                   help="hybrid sharding: stages 1-3 shard inside groups of G GPUs and replicate "
                        "across the N/G groups; G must divide N. '--shard-size' alone or 'node': "
                        "the GPUs per node of --hardware (8 on H100). default: flat, G = N")
    g.add_argument("--compress", choices=list(COMPRESSIONS), default="none",
                   help="bytes per element on the wire: " + "; ".join(
                       f"{k}: {v}" for k, v in COMPRESSION_ABOUT.items()))
    if block:
        g.add_argument("--block", type=_int_qty("block", 1, 1 << 20), default=QUANT_BLOCK,
                       help="elements per fp32 scale of int8 quantization (1 + 4/B bytes per element)")


def _gpus(p, default, help, least=1):
    """--gpus: the ranks N of a subcommand (at least ``least``)."""
    p.add_argument("--gpus", type=_int_qty("gpus", least, **_GPUS), default=default, help=help)


def _seq_len(p, default=None, help="sequence length"):
    """--seq-len (hidden old name --seq), as ``zerodp train`` names it."""
    _alias(p, "--seq-len", "--seq", dest="seq",
           type=_int_qty("seq-len", 1, MAX_SEQ, "ten million tokens at most"), default=default, help=help)


def _micro_batch(p, default=None, help="micro-batch size"):
    """--micro-batch (hidden old name --mbs): sequences per GPU per micro-batch."""
    _alias(p, "--micro-batch", "--mbs", dest="mbs", type=_int_qty("micro-batch", 1, MAX_MICRO_BATCH),
           default=default, help=help)


def _efficiency(p, default, help="fraction of peak FLOP/s reached"):
    """--efficiency: the fraction of peak FLOP/s the compute reaches."""
    p.add_argument("--efficiency", type=_qty("efficiency", 0, 1, "a fraction of peak FLOP/s"),
                   default=default, help=help)


def _global_batch_tokens(p, old, default, help):
    """--global-batch-tokens (hidden old name ``old``), as ``zerodp train`` names it."""
    _alias(p, "--global-batch-tokens", old, dest="global_batch_tokens",
           type=_qty("global-batch-tokens", 1, 1e15, "a quadrillion at most", count=True),
           default=default, help=help)


def _precision(p, default):
    """--mixed-precision (hidden old name --precision), as ``zerodp train`` names it."""
    _alias(p, "--mixed-precision", "--precision", dest="precision", choices=list(PRECISIONS),
           default=default, help="; ".join(f"{k}: {v['about']}" for k, v in PRECISIONS.items()))


def _attention(p, default):
    """--attention: the attention implementation of the activation model (guide §8)."""
    p.add_argument("--attention", choices=ATTENTION, default=default,
                   help="attention implementation (with --seq-len): flash: FlashAttention/SDPA, "
                        "stores no s x s scores (what training runs); eager: stores them")


def _optimizer(p, default):
    """--optimizer (plan memory, plan recommend): elementwise ones shard flat, per-tensor ones are
    priced by tensor ownership (zerodp.plan.ownership, guide §12.3)."""
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=default,
                   help="adamw/adam/sgd: elementwise, flat shards (k bytes per parameter); "
                        "adafactor, muon (Muon on the blocks' matrices, AdamW on the rest): whole "
                        "tensors, priced by tensor ownership (guide §12.3; needs the model's shape)")


_DURATION = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def _duration(what, high=1.0):
    """An argparse type: seconds, or a number with s/ms/us/ns ("5us", "0.2ms"), in [0, high]."""
    def parse(text):
        t = str(text).strip()
        unit = next((u for u in sorted(_DURATION, key=len, reverse=True)
                     if t.lower().endswith(u) and t[:-len(u)].strip()), "")
        try:
            v = float(t[:len(t) - len(unit)] if unit else t) * _DURATION.get(unit, 1.0)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"cannot read {what} {text!r}: a number of seconds, or with a unit: 5us, 0.2ms") from None
        if v != v or not 0 <= v <= high:
            raise argparse.ArgumentTypeError(range_sentence(what, 0, high, "seconds", text))
        return v
    parse.__name__ = what
    return parse


def _inter_group(p):
    """--inter-group-bw and --inter-group-latency: the link between replica groups (guide §16)."""
    g = p.add_argument_group("the link between replica groups (guide §16)")
    g.add_argument("--inter-group-bw", type=_qty("inter-group-bw", 1, 1e15, "1 B/s to 1 PB/s"),
                   metavar="BYTES_PER_S",
                   help="bandwidth between replica groups, bytes/s per GPU one way, e.g. 1.25GB "
                        "(10 Gbit/s) (default: the hardware's inter-node share per GPU)")
    g.add_argument("--inter-group-latency", type=_duration("inter-group-latency"), metavar="S",
                   help="latency of one ring step between groups: seconds, or 5us, 0.2ms "
                        "(default: the hardware's inter-node latency)")
    return g


def _diloco_options(p, compute=True):
    """--diloco-every/-fragments/-compress/-delay (guide §16), and what prices its step."""
    from zerodp.plan.diloco import OUTER_COMPRESSIONS
    g = p.add_argument_group("replica groups that talk rarely: DiLoCo (guide §16)")
    g.add_argument("--diloco-every", type=_int_qty("diloco-every", 1, 1_000_000), metavar="H",
                   help="DiLoCo: each shard group takes H inner steps alone, then the groups "
                        "average the pseudo-gradient (default: no outer loop)")
    g.add_argument("--diloco-fragments", type=_int_qty("diloco-fragments", 1, 1_000_000),
                   default=1, metavar="F",
                   help="Streaming DiLoCo: F fragments synced at staggered steps (at most H)")
    g.add_argument("--diloco-compress", choices=list(OUTER_COMPRESSIONS), default="none",
                   help="pseudo-gradients on the wire: none (fp32) or int8 (blockwise, 1 + 4/B "
                        "bytes per element)")
    g.add_argument("--diloco-delay", type=_int_qty("diloco-delay", 0, 1_000_000), default=0,
                   metavar="TAU", help="the exchange runs behind TAU inner steps (below H)")
    if compute:
        g.add_argument("--compute-ms", type=_qty("compute-ms", 0, 1e7, "milliseconds",
                                                 allow_zero=True),
                       help="measured compute of one inner step per GPU, ms (default: the "
                            "compute model at --seq-len x --micro-batch tokens, or not counted)")
        _seq_len(g, help="sequence length of an inner step's micro-batch (default: none; "
                         "the compute is then not counted unless --compute-ms)")
        _micro_batch(g, 1, "micro-batch of an inner step (with --seq-len)")
        g.add_argument("--overlap", action="store_true",
                       help="DDP's and hybrid ZeRO's cross-group collectives hide behind "
                            "backward (default: exposed, as the bench's simulated link)")


def _diloco_settings(args):
    """DiLoCoSettings from the flags, or None without --diloco-every (others then refused)."""
    from zerodp.plan.diloco import DiLoCoSettings
    if args.diloco_every is None:
        given = [f for f, v in (("--diloco-fragments", args.diloco_fragments != 1),
                                ("--diloco-compress", args.diloco_compress != "none"),
                                ("--diloco-delay", args.diloco_delay != 0),
                                ("--compute-ms", getattr(args, "compute_ms", None) is not None),
                                ("--overlap", getattr(args, "overlap", False))) if v]
        if given:
            raise ValueError(f"{given[0]} describes DiLoCo's outer loop: add --diloco-every H")
        return None
    return DiLoCoSettings(every=args.diloco_every, fragments=args.diloco_fragments,
                          compress=args.diloco_compress, delay=args.diloco_delay)


def _leg(nbytes_or_s, fmt):
    """A leg's bytes or time, "-" when the leg carries nothing."""
    return fmt(nbytes_or_s) if nbytes_or_s else "-"


def _comm_rows(steps):
    return [[s.stage_name, s.shard_size, s.replicas, _leg(s.intra_bytes, fmt_bytes),
             _leg(s.inter_bytes, fmt_bytes), _leg(s.intra_s, fmt_time), _leg(s.inter_s, fmt_time),
             fmt_time(s.time_s), s.bottleneck] for s in steps]


_COMM_HEAD = ["stage", "G", "R", "NVLink B/GPU", "NIC B/GPU", "NVLink time", "NIC time", "step comm",
              "slower"]


def _gb(nbytes: float) -> str:
    v = nbytes / GB
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"


def _share(fraction: float) -> str:
    """Exposed share of backward: "5.5%", or "8.4x" once it exceeds backward itself."""
    return f"{100 * fraction:.1f}%" if fraction < 1 else f"{fraction:.1f}x"


def _emit(args, result: dict, text: str) -> int:
    print(json.dumps(result, indent=2) if args.json else text)
    return 0


# ---------------------------------------------------------------------------------------------
def cmd_memory(args) -> int:
    hw = get_hardware(args.hardware)
    model = _model(args, default=MEM["model"])
    g = _shard_size(args, hw, args.gpus)
    mp = memory_plan(model, args.gpus, hw, args.precision, args.k, args.fp32_grad_acc, args.seq,
                     args.mbs, args.recompute, shard_size=g, optimizer=args.optimizer,
                     attention=args.attention)
    stages = [s for s in mp.stages if args.stage is None or s["stage"] == args.stage]
    limit = max_params(hw.hbm_bytes, args.bytes_per_param) if args.bytes_per_param else None
    result = dict(mp.to_dict(), stages=stages, hardware=hw.to_dict(),
                  fits={s["stage_name"]: s["fits"] for s in stages},
                  max_params=limit.to_dict() if limit else None)
    rows = [[s["stage_name"], _gb(s["param_bytes"]), _gb(s["grad_bytes"]), _gb(s["optimizer_bytes"]),
             _gb(s["grad_acc_bytes"]), _gb(s["gathered_unit_bytes"]), _gb(s["activation_bytes"]),
             _gb(s["model_state_bytes"]), _gb(s["total_bytes"]),
             {"fits": "yes", "tight": "tight", "no": "no"}[s["verdict"]]]
            for s in stages]
    act = mp.activations
    lines = [table(["stage", "params GB", "grads GB", "optim GB", "fp32 acc GB", "gathered GB",
                    "activ. GB", "states GB", "total GB", f"fits {hw.hbm_bytes / GB:.3g} GB"], rows,
                   title=f"Memory per GPU: {model.name}, Ψ = {fmt_count(model.params)}, "
                         f"N = {plural(args.gpus, 'GPU')}"
                         + (f" in {mp.replicas} shard groups of G = {mp.shard_size}"
                            if mp.shard_size != args.gpus else "") + f", {args.precision} "
                         f"(k = {mp.k:g}), fp32 grad accumulation: "
                         f"{'yes' if args.fp32_grad_acc else 'no'} ({hw.name})")]
    lines.append("total = " + " + ".join(mp.includes) + "; GB = 1e9 bytes; fits: total <= 90% of "
                 "HBM (10% headroom: CUDA context, NCCL buffers, allocator slack); tight: above "
                 "that, <= HBM")
    if act:
        lines.append(f"activations (Korthikanti et al. 2022, recompute={act['recompute']}, "
                     f"attention={act['attention']}, seq "
                     f"{act['seq']:,}, micro-batch {act['micro_batch']}): "
                     f"{fmt_bytes(act['per_layer_bytes'])} per layer, "
                     f"{fmt_bytes(act['total_bytes'])} in all")
    if args.optimizer in PER_TENSOR:
        lines += ["", _ownership_table(stages, args.optimizer)]
    lines += [f"note: {w}" for w in mp.warnings]
    if limit:
        lines.append(f"largest model at {args.bytes_per_param:g} bytes/param in {fmt_bytes(hw.hbm_bytes)}: "
                     f"{fmt_count(limit.max_params)} parameters")
    if mp.shard_size != args.gpus or args.compress != "none":
        steps = [step_comm(hw, args.gpus, s["stage"], model.params, g, args.precision, args.compress,
                           args.block) for s in stages]
        result["comm"] = [c.to_dict() for c in steps]
        lines += ["", table(_COMM_HEAD, _comm_rows(steps),
                            title=f"communication per step, compress {args.compress} (guide §14)")]
    return _emit(args, result, "\n".join(lines))


def _ownership_table(stages: list[dict], optimizer: str) -> str:
    """Tensor ownership per stage (guide §12.3): the fullest rank against the Ψ/N share."""
    rows = []
    for s in stages:
        o = s["ownership"]
        rows.append([s["stage_name"], f"{o['tensors']:,}", f"{o['groups']:,}",
                     f"{o['shard_numel'] / (o['params'] / o['n']):.3g}x",
                     fmt_bytes(o["max_state_bytes"]), fmt_bytes(o["mean_state_bytes"]),
                     f"{o['imbalance']:.3g}x", f"{o['comm_elements_per_step'] / o['params']:.3g}Ψ"])
    return "\n".join([
        table(["stage", "tensors", "groups", "slice / (Ψ/N)", "state, fullest rank", "state, Ψ/N share",
               "imbalance", "comm elements"], rows,
              title=f"Tensor ownership, {optimizer} (guide §12.3): each tensor whole on one rank "
                    f"of a shard group of {stages[0]['ownership']['n']}"),
        "slice: each rank's padded share of every group (master, gradient and ZeRO-3 parameter "
        "shards); comm: elements the step's collectives move over the padded groups"])


def cmd_comm_step(args) -> int:
    """A step's collectives by leg (guide §14): --params/--model, --stage, --shard-size, --compress;
    with --diloco-every, DDP, hybrid ZeRO and DiLoCo over the inter-group link (guide §16)."""
    if args.diloco_every is None:
        lone = [f for f, v in (("--inter-group-bw", args.inter_group_bw),
                               ("--inter-group-latency", args.inter_group_latency),
                               ("--seq-len", args.seq)) if v is not None]
        if lone:
            raise ValueError(f"{lone[0]} prices the DiLoCo table: add --diloco-every H")
    if args.bandwidth is not None or args.alpha is not None or args.latency is not None:
        raise ValueError("a step's collectives are priced on --hardware: drop --bandwidth/--alpha/"
                         "--latency, or drop --params/--model and give --bytes")
    if args.collective != "all":
        raise ValueError("--collective picks one collective of --bytes: a step (--params/--model) "
                         "runs its own; drop --collective")
    hw = get_hardware(args.hardware)
    params = (args.params if args.params is not None else load_config(args.config).params
              if args.config is not None else get_model(args.model).params)
    g = _shard_size(args, hw, args.gpus)
    stages = [args.stage] if args.stage is not None else [0, 1, 2, 3]
    steps = [step_comm(hw, args.gpus, st, params, g, args.precision, args.compress, args.block,
                       args.gathers) for st in stages]
    rows = []
    for st in steps:
        for c in st.collectives:
            group = {"all": f"all {st.n}", "shard": f"group of {c['ranks']}",
                     "replica": f"{c['ranks']} replicas"}[c["group"]]
            rows.append([st.stage_name, c["kind"] + (f" x{c['count']}" if c["count"] != 1 else ""),
                         group, fmt_bytes(c["nbytes"]), _leg(c["intra_bytes"], fmt_bytes),
                         _leg(c["inter_bytes"], fmt_bytes), _leg(c["intra_s"], fmt_time),
                         _leg(c["inter_s"], fmt_time)])
    w = steps[0].wire
    g_text = ("flat over all N" if steps[0].shard_size == args.gpus
              else f"G = {steps[0].shard_size}, R = {steps[0].replicas} replicas")
    head = (f"One step's collectives per GPU: Ψ = {fmt_count(params)} on {plural(args.gpus, 'GPU')} "
            f"({hw.name}, {hw.devices_per_node} per node), {g_text}, {args.precision}, compress "
            f"{args.compress}: parameters {w['wire_param_bytes']:.4g} B, gradients "
            f"{w['wire_grad_bytes']:.4g} B per element on the wire")
    text = "\n".join([
        table(["stage", "collective", "over", "V", "NVLink B/GPU", "NIC B/GPU", "NVLink time",
               "NIC time"], rows, title=head),
        "", table(_COMM_HEAD, _comm_rows(steps),
                  title="per step: each leg's collectives one after another, the legs side by side "
                        "(the slower one sets the step's communication time)"),
        "NIC B/GPU: each GPU's share of its node's NIC bytes; ring bytes per rank by group "
        "(what the engine measures): " + "; ".join(
            f"{s.stage_name} intra {fmt_bytes(s.ring_bytes['intra'])}, inter {fmt_bytes(s.ring_bytes['inter'])}"
            for s in steps)])
    result = {"steps": [s.to_dict() for s in steps]}
    outer = _diloco_settings(args)
    if outer is not None:
        plan = _diloco_table(args, hw, params, g, outer)
        result["diloco"] = plan.to_dict()
        from zerodp.plan.diloco import text as diloco_text
        text += "\n\n" + diloco_text(plan)
    return _emit(args, result, text)


def _diloco_table(args, hw, params, g, outer):
    """DDP, hybrid ZeRO and DiLoCo at --stage (3 when all stages are shown; guide §16)."""
    from zerodp.plan.diloco import diloco_plan
    if g is None or g >= args.gpus:
        raise ValueError("DiLoCo's replica groups are the shard groups: give --shard-size G "
                         f"below --gpus {args.gpus} (at least two groups)")
    if args.compress != "none":
        raise ValueError("--compress narrows hybrid ZeRO's wire; the DiLoCo table compares "
                         "uncompressed inner steps: drop --compress (the pseudo-gradients' "
                         "compression is --diloco-compress)")
    model = (get_model(args.model) if args.model is not None else load_config(args.config)
             if args.config is not None else params)
    return diloco_plan(model, hw, args.gpus, g, 3 if args.stage is None else args.stage, outer,
                       precision=args.precision, numel=params,
                       compute_s=None if args.compute_ms is None else args.compute_ms / 1e3,
                       seq=args.seq, micro_batch=args.mbs, inter_group_bw=args.inter_group_bw,
                       inter_group_latency=args.inter_group_latency, overlap=args.overlap,
                       gathers_per_step=args.gathers)


def cmd_comm(args) -> int:
    if args.params is not None or args.model is not None or args.config is not None:
        if args.bytes is not None:
            raise ValueError("give --bytes (one collective) or --params/--model/--config (a "
                             "step's collectives), not both")
        named = [f for f, v in (("--model", args.model), ("--config", args.config),
                                ("--params", args.params)) if v is not None]
        if len(named) > 1:
            raise ValueError(f"give {named[0]} or {named[1]}, not both")
        return cmd_comm_step(args)
    step_only = [f for f, v in (("--shard-size", args.shard_size), ("--stage", args.stage),
                                ("--compress", args.compress != "none"),
                                ("--diloco-every", args.diloco_every),
                                ("--inter-group-bw", args.inter_group_bw),
                                ("--inter-group-latency", args.inter_group_latency),
                                ("--seq-len", args.seq)) if v is not None and v is not False]
    if step_only:
        raise ValueError(f"{step_only[0]} applies to a step's collectives: give --params or --model "
                         "(with --stage), or drop it and price one collective of --bytes")
    if args.bytes is None:
        raise ValueError("give --bytes V (one collective), or --params/--model/--config (a step's "
                         "collectives)")
    kinds = KINDS if args.collective == "all" else [args.collective]
    if args.bandwidth is not None:
        if args.latency is not None and args.alpha is not None:
            raise ValueError("give --alpha or --latency, not both")
        cost = (RingCost.from_latency(args.latency, args.bandwidth, args.gpus) if args.latency is not None
                else RingCost(args.alpha or 0.0, args.bandwidth, args.gpus))
        results = [cost.collective(k, args.bytes) for k in kinds]
        where = f"flat ring, α = {fmt_time(cost.alpha)}/step, W = {fmt_bytes(cost.bandwidth)}/s"
    else:
        if args.alpha is not None or args.latency is not None:
            raise ValueError("--alpha/--latency need --bandwidth (a flat ring); or use --hardware")
        hw = get_hardware(args.hardware)
        results = [collective_time(k, args.bytes, args.gpus, hw) for k in kinds]
        where = hw.name
    rows = []
    for r in results:
        for leg in (r.legs or [dict(r.to_dict(), leg="ring")]):
            rows.append([r.kind, leg["leg"], leg["n"], fmt_time(leg["time_s"]), fmt_time(leg["latency_s"]),
                         fmt_time(leg["bandwidth_s"]), fmt_bytes(leg["crossover_bytes"]),
                         fmt_bytes(leg["latency_bytes"]),
                         "-" if leg["busbw"] is None else f"{leg['busbw'] / GB:.3g}",
                         "*" if leg["leg"] == r.bottleneck or len(r.legs) <= 1 else ""])
    text = table(["collective", "leg", "ranks", "time", "latency", "bandwidth", "V*=NαW", "α′·W",
                  "busbw GB/s", "slower"], rows,
                 title=f"{fmt_bytes(args.bytes)} on {plural(args.gpus, 'rank')} ({where}); a collective takes "
                       "as long as its slower leg (*)")
    return _emit(args, {"results": [r.to_dict() for r in results]}, text)


def cmd_roofline(args) -> int:
    if args.model is not None and args.config is not None:
        raise ValueError("give --model or --config, not both")
    named = args.model if args.config is None else load_config(args.config)
    if named is not None and (args.experts is not None or args.top_k is not None):
        raise ValueError(f"{'--model' if args.config is None else '--config'} sets E and k; drop "
                         "--experts/--top-k, or drop it and give --experts/--top-k alone")
    moe = dict(model=named, experts=args.experts or 1, experts_per_token=args.top_k or 1)
    if named is None:
        moe.pop("model")
    hw = get_hardware(args.hardware)
    levers = dict(shard_size=_shard_size(args, hw, args.gpus), compress=args.compress, block=args.block)
    r = threshold(hw, args.gpus, args.axes, **moe, **levers)
    result = {"threshold": r.to_dict(), "max_devices": None}
    rows = [["C/W inside a node (uncorrected)", f"{r.intra_c_over_w:,.0f}", "tokens/device"],
            ["C/W across nodes (uncorrected)",
             "-" if r.inter_c_over_w is None else f"{r.inter_c_over_w:,.0f}", "tokens/device"],
            ["(g-1)/g, (R-1)/R" if r.shard_size else "(g-1)/g, (m-1)/m", f"{r.intra_factor:.3f}, " + (
                "-" if r.inter_factor is None else f"{r.inter_factor:.3f}"), ""],
            [f"dense threshold ({r.bottleneck} leg)", f"{r.dense_threshold_tokens:,.0f}", "tokens/device"],
            ["MoE factor E/k (routed experts only)", f"{r.moe_factor:g}", "x"],
            ["MoE: total / active parameters (shared experts, dense layers)",
             "-" if named is None else f"{get_model(named).active_factor:.3g}", "x"],
            [f"wire bytes/element: gradients, parameters ({r.compress})",
             roofline_labels(r)["wire"], "B"],
            ["sync bytes/param per GPU: NVLink, NIC share",
             roofline_labels(r)["sync"], "B"],
            ["threshold", f"{r.threshold_tokens:,.0f}", "tokens/device"]]
    if r.min_batch_tokens is not None:
        rows.append([f"min global batch on {r.n}", fmt_count(r.min_batch_tokens), "tokens"])
    if args.global_batch_tokens:
        m = max_devices(hw, args.global_batch_tokens, args.axes, **moe, **levers)
        result["max_devices"] = m.to_dict()
        rows.append([f"max devices for {fmt_count(args.global_batch_tokens)} tokens", f"{m.max_devices:,}", "devices"])
    where = "at scale (many nodes)" if args.gpus is None else f"on {args.gpus} devices"
    if r.shard_size is not None:
        where += f", shard groups of G = {r.shard_size}" + (f" (R = {r.replicas})" if r.replicas else "")
    text = table(["quantity", "value", "unit"], rows, align="lrl",
                 title=f"DP/FSDP roofline, {r.hardware} {where}, {args.axes} axis(es): "
                       "compute-bound iff tokens/device > threshold")
    return _emit(args, result, text)


def cmd_batch(args) -> int:
    b = plan_batch(args.global_batch_tokens, args.seq, args.mbs, args.gpus, not args.no_round)

    rows = [["global batch", f"{b.samples:,}", "samples"],
            ["global batch", fmt_count(b.global_batch_tokens), "tokens"],
            ["micro-batch", b.micro_batch, "samples/GPU"], ["dp", b.dp, "GPUs"],
            ["grad_acc", b.grad_acc, f"steps (exact {b.exact_grad_acc:.3g})"],
            ["processed per step", f"{b.effective_samples:,}", "samples"]]
    text = table(["quantity", "value", "unit"], rows, align="lrl",
                 title="gbs = mbs x grad_acc x dp (guide §6.1)")
    if b.warnings:
        text += "\n" + "\n".join("warning: " + w for w in b.warnings)
    return _emit(args, b.to_dict(), text)


def cmd_simulate(args) -> int:
    given_bucket = args.bucket is not None or args.bucket_mb != SIM["bucket_bytes"] / 2**20
    ignored = ([f for f, v in (("--bucket-mb", given_bucket),
                               ("--whole-layers", args.whole_layers),
                               ("--sweep", args.sweep)) if v] if args.fsdp
               else (["--no-prefetch"] if args.no_prefetch else []))
    if ignored:
        raise ValueError(f"{ignored[0]} " + ("does not apply to --fsdp (FSDP has no gradient "
                                             "buckets): drop it" if args.fsdp else
                                             "only applies with --fsdp: add --fsdp or drop it"))
    if args.alpha is not None and args.latency is not None:
        raise ValueError("give --alpha or --latency, not both")
    if args.bucket is None:  # the old spelling --bucket (bytes) wins when given
        args.bucket = args.bucket_mb * 2**20
    hw = get_hardware(args.hardware)
    model = _model(args, default=SIM["model"])
    if args.efficiency <= 0:
        raise ValueError("--efficiency must be > 0 (a fraction of peak FLOP/s, e.g. 0.5)")
    layers = model_layers(model, hw, args.tokens_per_gpu, args.efficiency)
    if args.bandwidth is not None:
        cost = (RingCost.from_latency(args.latency, args.bandwidth, args.gpus) if args.latency is not None
                else RingCost(args.alpha or 0.0, args.bandwidth, args.gpus))
    else:
        if args.alpha is not None or args.latency is not None:
            raise ValueError("--alpha/--latency need --bandwidth (a flat ring); or change --hardware")
        cost = network_cost(hw, args.gpus)
    head = (f"{model.name} on {args.gpus}x{hw.name}, {fmt_count(args.tokens_per_gpu)} tokens/GPU, "
            f"{_units_words(layers)}, {fmt_bytes(sum(l.param_bytes for l in layers))} of gradients")
    if args.fsdp:
        f = simulate_fsdp(layers, cost, prefetch=not args.no_prefetch)
        rows = [["compute (fwd + bwd)", fmt_time(f.compute_s)], ["step", fmt_time(f.step_s)],
                ["exposed communication", fmt_time(f.exposed_comm_s)],
                ["communication (sum)", fmt_time(f.comm_s)],
                ["AllGathers (2L-1)", f.num_allgathers], ["ReduceScatters", f.num_reduce_scatters]]
        text = table(["FSDP (ZeRO-3)", "value"], rows, title=head)
        if args.plot:
            from zerodp.plan.plot import plot_timeline
            plot_timeline(f, args.plot)
            text += f"\nplot written to {args.plot}"
        return _emit(args, {"model": model.name, "fsdp": f.to_dict(), "sweep": None}, text)
    t = simulate_backward(layers, cost, args.bucket, split_layers=not args.whole_layers)
    last = t.last_bucket
    rows = [["buckets", f"{t.num_buckets:,}", f"of {fmt_bytes(args.bucket)}"],
            ["backward compute", fmt_time(t.backward_s), ""],
            ["communication (sum)", fmt_time(t.comm_s),
             f"latency {fmt_time(t.latency_s)} + bandwidth {fmt_time(t.bandwidth_s)}"],
            ["last bucket", fmt_time(last.end_s - last.start_s),
             f"ready {fmt_time(last.ready_s)}, ends {fmt_time(last.end_s)}"],
            ["exposed communication", fmt_time(t.exposed_comm_s), f"{_share(t.exposed_fraction)} of backward"],
            ["step (fwd + bwd + exposed)", fmt_time(t.step_s), ""]]
    text = table(["bucketed backward", "value", "note"], rows, align="lrl", title=head)
    sweep = None
    if args.sweep or args.plot:
        sweep = sweep_buckets(layers, cost, split_layers=not args.whole_layers)
        srows = [[fmt_bytes(p.bucket_bytes), f"{p.num_buckets:,}", fmt_time(p.comm_s),
                  fmt_time(p.exposed_comm_s), _share(p.exposed_fraction), fmt_time(p.step_s)]
                 for p in sweep.points]
        if args.sweep:
            text += "\n\n" + table(["bucket", "buckets", "comm", "exposed", "of bwd", "step"], srows,
                                   title=f"bucket-size sweep (least exposed: {fmt_bytes(sweep.best_bucket_bytes)})")
    if args.plot:
        from zerodp.plan.plot import plot_timeline
        plot_timeline(t, args.plot, sweep)
        text += f"\nplot written to {args.plot}"
    return _emit(args, {"model": model.name, "timeline": t.to_dict(),
                        "sweep": sweep.to_dict() if sweep else None}, text)


def _units_words(layers) -> str:
    """What the simulator runs, in words: "32 blocks + embedding + head" (not "34 layers")."""
    blocks = sum(1 for l in layers if l.name.startswith("block"))
    extra = [l.name for l in layers if not l.name.startswith("block")]
    return " + ".join([f"{blocks} block{'s' if blocks != 1 else ''}"] + extra)


def _cluster(args, hw):
    """(nodes, GPUs per node) from --nodes/--gpus-per-node/--gpus (guide §14)."""
    gpn = args.gpus_per_node or hw.devices_per_node
    if args.gpus is not None:
        if args.nodes is not None and args.nodes * gpn != args.gpus:
            raise ValueError(f"--gpus {args.gpus} is not --nodes {args.nodes} x --nproc "
                             f"{gpn}: give --gpus, or --nodes and --nproc")
        if args.gpus <= gpn and args.gpus_per_node is None:
            return 1, args.gpus
        if args.gpus % gpn:
            raise ValueError(f"--gpus {args.gpus} does not fill nodes of {gpn} GPUs: give a multiple "
                             f"of --nproc {gpn}")
        return args.gpus // gpn, gpn
    return args.nodes or REC["nodes"], gpn


def cmd_recommend(args) -> int:
    """The fastest configuration that fits (guide §6.1, §7, §9, §14)."""
    from zerodp.plan.hardware import with_power_limit
    from zerodp.plan.recommend import BUCKET_MB, SEARCH_COMPRESSIONS, recommend, text
    from zerodp.plan.hardware import with_inter_group
    hw = with_power_limit(get_hardware(args.hardware), args.power_limit)
    hw = with_inter_group(hw, args.inter_group_bw, args.inter_group_latency)
    model = _model(args, default=REC["model"])
    nodes, gpn = _cluster(args, hw)
    outer = _diloco_settings(args)
    r = recommend(model, hw, nodes, gpn, args.global_batch_tokens, args.seq,
                  precision=args.precision, efficiency=args.efficiency,
                  stages=(args.stage,) if args.stage is not None else (0, 1, 2, 3),
                  recompute=(args.recompute,) if args.recompute else RECOMPUTE,
                  compress=(args.compress,) if args.compress else SEARCH_COMPRESSIONS,
                  bucket_mb=(args.bucket_mb,) if args.bucket_mb else BUCKET_MB,
                  micro_batches=(args.mbs,) if args.mbs else None, top=args.top,
                  headroom=args.headroom, attention=args.attention, optimizer=args.optimizer,
                  diloco=outer)
    return _emit(args, r.to_dict(), text(r))


def cmd_report(args) -> int:
    r = build_report()
    return _emit(args, r.to_dict(), r.text())


def cmd_validate(args) -> int:
    """The planner against published FSDP runs; status 1 when a run is outside its band."""
    from zerodp.plan.report import VALIDATION_FILE, FITTED, fit_constants, load_validation, validate
    path = args.table or VALIDATION_FILE
    constants = fit_constants(load_validation(path)["runs"]) if args.fit else None
    v = validate(constants, path, with_holdout=args.holdout)
    _emit(args, v.to_dict(), v.text())
    if args.fit and not args.json:
        print("fitted on every run: " + ", ".join(f"{k} = {getattr(constants, k):.3g}" for k in FITTED))
    return 0 if v.ok else 1


def _nodes_list(text):
    """``--nodes`` of plan goodput: one count or a comma-separated list (a row each)."""
    parse = _int_qty("nodes", 1, **_GPUS)
    return [parse(t) for t in str(text).split(",") if t.strip()]


def cmd_goodput(args) -> int:
    """Restart from a checkpoint vs heal from a peer replica group, under node failures
    (zerodp.plan.goodput, docs/reliability.md)."""
    from zerodp.plan.goodput import HOUR, fmt_duration, goodput_table
    hw = get_hardware(args.hardware)
    gpn = args.gpus_per_node or hw.devices_per_node
    g = gpn if args.shard_size in (None, NODE) else args.shard_size
    if args.state_bytes is None:
        model = _model(args, default="llama3-8b")
        mp = memory_plan(model, max(args.nodes) * gpn, hw, args.precision, shard_size=g)
        row = next(s for s in mp.stages if s["stage"] == args.stage)
        state, what = row["param_bytes"] + row["optimizer_bytes"], (
            f"{model.name} at stage {args.stage}, {args.precision}: parameters and optimizer state")
    else:
        state, what = args.state_bytes, "given"
    bw = args.transfer_bw or hw.inter_group_bw or hw.inter_bw / gpn
    if not bw:
        raise ValueError(f"{hw.name} has no inter-node network: give --transfer-bw")
    plans = goodput_table(args.nodes, gpus_per_node=gpn, shard_size=g,
                          mtbf_node_s=args.mtbf_hours * HOUR, state_bytes=state, transfer_bw=bw,
                          ckpt_s=args.ckpt_s, restart_s=args.restart_s, quorum_s=args.quorum_s,
                          step_s=args.step_s, interval_s=args.ckpt_interval_s)
    pct = "{:.1%}".format
    rows = [[f"{p.nodes:,}", f"{p.gpus:,}", f"{p.replicas:,}", fmt_duration(p.job_mtbf_s),
             fmt_duration(p.interval_s), pct(p.restart_goodput), fmt_duration(p.best_interval_s),
             pct(p.restart_best_goodput), fmt_duration(p.heal.down_s), pct(p.heal.goodput),
             f"{100 * p.gain:+.1f} pts", f"{p.gain * p.gpus * 24:,.0f}"] for p in plans]
    first = plans[0]
    head = (f"Goodput under failures (committed work / fault-free): {hw.name}, {gpn} GPUs per node, "
            f"MTBF {args.mtbf_hours:,.0f} h per node, replica groups of {g} GPUs "
            f"(failure domain: {first.domains.what}); checkpoint write {fmt_duration(args.ckpt_s)}, "
            f"restart {fmt_duration(args.restart_s)}, quorum {fmt_duration(args.quorum_s)}, step "
            f"{fmt_duration(args.step_s)}")
    interval = "given" if args.ckpt_interval_s is not None else "Young, sqrt(2 C M)"
    text = "\n".join([
        table(["nodes", "GPUs", "R", "job MTBF", f"ckpt every ({interval.split(',')[0]})",
               "restart", "best every", "restart there", "group down", "heal",
               "heal - restart", "GPU-h/day"], rows, title=head),
        f"restart: every rank from the newest checkpoint, G = tau / (M e^(R/M) (e^((tau+C)/M) - 1)) "
        f"(Daly 2006) at tau = {interval} and at the best tau; heal: the failed group restarts and "
        f"fetches {fmt_bytes(state)} per GPU ({what}) from a peer at {fmt_bytes(bw)}/s "
        f"({fmt_duration(first.transfer_s)}) while R-1 groups step on, each failure and rejoin "
        f"stalling them one step and a quorum (zerodp.plan.goodput)",
        "GPU-h/day: GPU-hours of work a day that healing keeps and restarting loses (vs restart "
        "at the best tau)"])
    return _emit(args, {"plans": [p.to_dict() for p in plans]}, text)


# ---------------------------------------------------------------------------------------------
def add_parser(subparsers) -> None:
    plan = subparsers.add_parser("plan", help="the guide's cost models: memory, comm, roofline, "
                                 "batch, simulate, recommend (the fastest setup that fits), report",
                                 description="Plan data-parallel training with the guide's cost models.")
    sub = plan.add_subparsers(dest="plan_command", metavar="SUBCOMMAND")
    plan.set_defaults(func=lambda a: (plan.print_help(), 2)[1])

    p = sub.add_parser("memory", help="the bill per GPU for stages 0-3 and whether it fits",
                       description="Parameters, gradients, optimizer states, fp32 accumulation, "
                                   "ZeRO-3's gathered units and activations per GPU (guide §8-§9); "
                                   "'fits' compares their sum with the hardware's HBM.",
                       formatter_class=_Help)
    _common(p, model=True)
    _gpus(p, MEM["n"], "data-parallel GPUs N")
    p.add_argument("--stage", type=int, choices=[0, 1, 2, 3], help="one stage (default: all)")
    _precision(p, MEM["precision"])
    p.add_argument("--k", type=_qty("k", 0, MAX_K, "Adam with fp64 states needs 24",
                                    allow_zero=True),
                   help="optimizer bytes per parameter (default: the precision's, 12 for bf16)")
    p.add_argument("--fp32-grad-acc", action="store_true", help="add the fp32 gradient accumulation buffer")
    _optimizer(p, MEM["optimizer"])
    _seq_len(p, help="sequence length: adds activations (default: none counted)")
    _micro_batch(p, MEM["micro_batch"], "micro-batch size (with --seq-len)")
    p.add_argument("--recompute", choices=RECOMPUTE, default=MEM["recompute"],
                   help="activation recomputation (with --seq-len): none; selective: the attention "
                        "core again in backward; full: only each block's input is kept")
    _attention(p, MEM["attention"])
    p.add_argument("--bytes-per-param", type=_qty("bytes-per-param", 0, MAX_K),
                   help="also print the largest model at this many bytes/param (default: not shown)")
    _levers(p)
    p.set_defaults(func=cmd_memory)

    flat = dict(alpha=("--alpha", "flat ring: seconds per ring step (with --bandwidth)"),
                latency=("--latency", "flat ring: small-message AllReduce latency α′ in seconds "
                                      "(with --bandwidth)"))

    def ring_options(q):
        for _, (flag, text) in flat.items():
            q.add_argument(flag, type=_qty(flag[2:], 0, 1, "a second per step at most",
                                           allow_zero=True), help=text)
        q.add_argument("--bandwidth", type=_qty("bandwidth", 1e3, 1e15, "1 kB/s to 1 PB/s"),
                       help="flat ring: bytes/s per rank, one way (default: from --hardware)")

    p = sub.add_parser("comm", help="AllReduce/ReduceScatter/AllGather time (alpha-beta, ring, two legs)",
                       description="Time of one collective of --bytes (AllReduce, ReduceScatter, AllGather) on --gpus "
                                   "ranks with the alpha-beta ring model (guide §2.4), each leg priced separately past"
                                   " one node; or, with --params/--model, every collective of one step per stage, with"
                                   " hybrid sharding and compression (guide §14, §15).",
                       formatter_class=_Help)
    _common(p)
    p.add_argument("--bytes", type=_qty("bytes", 0, 1e15, "1 PB at most", allow_zero=True),
                   help="V of one collective, e.g. 16e9 or 25MB (or give --params/--model for a step)")
    _gpus(p, 8, "ranks N")
    p.add_argument("--collective", default="all", choices=["all", *KINDS], help="which collective")
    ring_options(p)
    s = p.add_argument_group("a step's collectives instead of one (guide §14)")
    s.add_argument("--params", type=_qty("params", 1, MAX_PARAMS, "a thousand trillion at most",
                                         count=True),
                   help="parameter count Ψ, e.g. 7.5e9 or 70B (default: none; one collective of --bytes)")
    s.add_argument("--model", metavar="NAME", help=f"Ψ from a preset: {', '.join(model_names())}")
    s.add_argument("--config", metavar="PATH",
                   help="Ψ from a Hugging Face config.json (or a model directory holding one)")
    s.add_argument("--stage", type=int, choices=[0, 1, 2, 3], help="one stage (default: all)")
    _precision(s, MEM["precision"])
    s.add_argument("--gathers", type=_int_qty("gathers", 0, 1000), default=2,
                   help="stage 3: parameter AllGathers per step (forward, again in backward)")
    _levers(p)
    _diloco_options(p)
    _inter_group(p)
    p.set_defaults(func=cmd_comm)

    p = sub.add_parser("roofline", help="tokens per GPU to stay compute-bound; min batch; max GPUs",
                       description="The roofline of guide §7: tokens each GPU must run per step for its compute to "
                                   "hide the gradient traffic (C/W, times the MoE factor), the smallest global batch "
                                   "that keeps N GPUs compute-bound, and with --batch-tokens the most GPUs a batch can"
                                   " use.",
                       formatter_class=_Help)
    _common(p)
    _gpus(p, ROOF["n"], "devices (default: at scale, many nodes)")
    p.add_argument("--axes", type=_int_qty("axes", 1, 3, "a mesh has at most 3 axes"),
                   default=ROOF["axes"],
                   help="mesh axes doing DP (TPU v5p: up to 3)")
    p.add_argument("--model", metavar="NAME",
                   help=f"MoE factor E/k from a preset ({', '.join(model_names())}; default: dense)")
    p.add_argument("--config", metavar="PATH",
                   help="MoE factor E/k from a Hugging Face config.json (default: dense)")
    p.add_argument("--experts", type=_int_qty("experts", 1, 100_000),
                   help="MoE: experts E (default 1: dense)")
    p.add_argument("--top-k", type=_int_qty("top-k", 1, 100_000),
                   help="MoE: experts per token k (default 1)")
    _global_batch_tokens(p, "--batch-tokens", ROOF["batch_tokens"],
                         "global batch: also the most devices it can use (Llama 3's final 16M tokens)")
    _levers(p)
    p.set_defaults(func=cmd_roofline)

    p = sub.add_parser("batch", help="samples and grad_acc from a global batch in tokens (guide §6.1)",
                       description="Guide §6.1: the global batch in samples (tokens / seq, rounded to a power of two "
                                   "unless --no-round) and the gradient accumulation that reaches it, gbs = micro-"
                                   "batch x grad_acc x dp; warns when grad_acc would be below 1 (GPU-rich).",
                       formatter_class=_Help)
    _common(p, hardware=False)
    _global_batch_tokens(p, "--tokens", BATCH["target_tokens"], "target global batch, e.g. 4Mi")
    _seq_len(p, BATCH["seq"])
    _micro_batch(p, BATCH["micro_batch"], "largest micro-batch that fits")
    _gpus(p, BATCH["dp"], "data-parallel GPUs dp")
    p.add_argument("--no-round", action="store_true", help="do not round samples to a power of two")
    p.set_defaults(func=cmd_batch)

    p = sub.add_parser("simulate", help="event simulation of bucketed overlap or FSDP prefetch",
                       description="Event simulation of one backward (guide §4): gradient buckets of --bucket bytes "
                                   "reduced while the rest of backward runs, the exposed communication, and with "
                                   "--sweep the bucket sizes around the sweet spot; with --fsdp, ZeRO-3/FSDP per-unit "
                                   "AllGathers and ReduceScatters with or without prefetch. The units are the model's "
                                   "blocks plus its embedding and head.",
                       formatter_class=_Help)
    _common(p, model=True)
    _gpus(p, SIM["n"], "data-parallel GPUs", least=2)
    _alias(p, "--tokens-per-rank", "--tokens-per-gpu", dest="tokens_per_gpu",
           type=_qty("tokens-per-rank", 1, 1e9, "a billion at most", count=True),
           default=SIM["tokens_per_gpu"], help="tokens each GPU (rank) runs per step")
    p.add_argument("--bucket-mb", type=_qty("bucket-mb", 1 / 2**20, 1e13 / 2**20, "10 TB at most"),
                   default=SIM["bucket_bytes"] / 2**20,
                   help=f"bucket size in MiB, as zerodp train --bucket-mb (PyTorch DDP's "
                        f"bucket_cap_mb; at most {MAX_BUCKETS:,} buckets per simulation)")
    p.add_argument("--bucket", type=_qty("bucket", 1, 1e13, "10 TB at most"),
                   help=argparse.SUPPRESS)  # the old spelling, in bytes
    _efficiency(p, 1.0)
    p.add_argument("--whole-layers", action="store_true", help="close buckets only at layer boundaries")
    p.add_argument("--sweep", action="store_true", help="also sweep bucket sizes")
    p.add_argument("--fsdp", action="store_true", help="ZeRO-3/FSDP: per-unit AllGather + ReduceScatter")
    p.add_argument("--no-prefetch", action="store_true", help="FSDP without prefetch (with --fsdp)")
    ring_options(p)
    p.add_argument("--plot", metavar="FILE.png", help="draw the timeline (and sweep) to a PNG")
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("recommend", help="the fastest configuration that fits, ranked",
                       description="Search stage x shard group x micro-batch x grad_acc x "
                                   "recomputation x compression x bucket size for a model on a "
                                   "cluster and a target global batch; keep what fits with "
                                   "headroom; rank by predicted step time (docs/planner.md). "
                                   "--optimizer prices each configuration's states and "
                                   "collectives for that optimizer (tensor ownership for "
                                   "adafactor and muon, as plan memory).",
                       formatter_class=_Help)
    _common(p, model=True)
    _cluster_options(p)
    _global_batch_tokens(p, "--tokens", REC["global_batch_tokens"], "target global batch in tokens, e.g. 4M or 4Mi")
    _seq_len(p, REC["seq"])
    _precision(p, MEM["precision"])
    _optimizer(p, REC["optimizer"])
    _attention(p, REC["attention"])
    _efficiency(p, REC["efficiency"], "fraction of peak FLOP/s the compute reaches (default: the "
                "hardware's compute model, docs/planner.md)")
    p.add_argument("--power-limit", type=_qty("power-limit", 1, 10_000, "watts"), metavar="W",
                   help="board power limit in watts, below the part's TDP: the compute clock "
                        "scales by (W/TDP)^(1/3) (default: the preset's)")
    p.add_argument("--headroom", type=_qty("headroom", 0, 0.99, "a fraction of HBM",
                                           allow_zero=True), default=REC["headroom"],
                   help="fraction of HBM kept free: CUDA context, NCCL buffers, allocator slack")
    p.add_argument("--top", type=_int_qty("top", 1, 100), default=5, help="configurations shown")
    s = p.add_argument_group("fix one lever instead of searching it")
    s.add_argument("--stage", type=int, choices=[0, 1, 2, 3], help="one stage (default: all)")
    s.add_argument("--recompute", choices=RECOMPUTE,
                   help="one recomputation (default: all)")
    s.add_argument("--compress", choices=list(COMPRESSIONS), help="one compression (default: all)")
    s.add_argument("--bucket-mb", type=_qty("bucket-mb", 0.001, 1e6, "a TB at most"),
                   help="one bucket size in MiB (default: 25, 100, 400)")
    _micro_batch(s, help="one micro-batch (default: powers of two up to 64)")
    _diloco_options(p, compute=False)
    _inter_group(p)
    p.set_defaults(func=cmd_recommend)

    p = sub.add_parser("goodput", help="restart from a checkpoint vs heal from a peer, under "
                       "node failures", formatter_class=_Help,
                       description="Goodput (committed work over a fault-free run's) when nodes "
                                   "fail at random with --mtbf-hours each: restarting every rank "
                                   "from the newest checkpoint (Young's and the best checkpoint "
                                   "interval) against torchft-style replica groups, where only the "
                                   "failed group restarts and heals from a live peer while the "
                                   "others step on (docs/reliability.md, 'Goodput under "
                                   "failures').")
    _common(p, model=True)
    from zerodp.plan.goodput import CKPT_S, LLAMA3_NODE_MTBF_H, QUORUM_S, RESTART_S, STEP_S
    g = p.add_argument_group("cluster and failures")
    g.add_argument("--nodes", type=_nodes_list, default=[16, 128, 512, 2048], metavar="N[,N...]",
                   help="nodes: one count, or several separated by commas (a row each)")
    _alias(g, "--nproc", "--gpus-per-node", dest="gpus_per_node",
           type=_int_qty("nproc", 1, 100_000), default=None,
           help="GPUs (ranks) per node (default: the hardware's, 8 on H100)")
    g.add_argument("--shard-size", type=_shard_size_type, default=NODE, metavar="G",
                   help="GPUs per replica group, a multiple or a divisor of --nproc; 'node': "
                        "one node per group")
    g.add_argument("--mtbf-hours", type=_qty("mtbf-hours", 0, 1e9, "hours"),
                   default=round(LLAMA3_NODE_MTBF_H), metavar="H",
                   help="mean time between failures of one node, hours (default: Llama 3 405B's "
                        "419 unexpected interruptions in 54 days on 2,048 nodes)")
    c = p.add_argument_group("times (seconds)")
    for flag, dflt, text in (
            ("--ckpt-s", CKPT_S, "a checkpoint write, blocking"),
            ("--restart-s", RESTART_S, "from a failure to the first new step: detect, start, "
                                       "initialise, read the checkpoint"),
            ("--quorum-s", QUORUM_S, "a quorum change: the lighthouse notices the failure or "
                                     "the rejoin and the process groups reconfigure"),
            ("--step-s", STEP_S, "one training step (the one in flight at a failure is lost)")):
        c.add_argument(flag, type=_qty(flag[2:], 0, 1e9, "seconds", allow_zero=True),
                       default=dflt, metavar="S", help=text)
    c.add_argument("--ckpt-interval-s", type=_qty("ckpt-interval-s", 0, 1e9, "seconds"),
                   metavar="S", help="compute between checkpoints of the restart path (default: "
                                     "Young's sqrt(2 C M))")
    s = p.add_argument_group("what a healing GPU fetches")
    s.add_argument("--stage", type=int, choices=[0, 1, 2, 3], default=3,
                   help="ZeRO stage: the shard of parameters and optimizer state per GPU")
    _precision(s, MEM["precision"])
    s.add_argument("--state-bytes", type=_qty("state-bytes", 0, 1e15, "a PB at most",
                                              allow_zero=True),
                   help="bytes per GPU to fetch (default: the model's parameters and optimizer "
                        "state at --stage over the group)")
    s.add_argument("--transfer-bw", type=_qty("transfer-bw", 1, 1e15, "1 B/s to 1 PB/s"),
                   metavar="BYTES_PER_S",
                   help="bytes/s per GPU of that fetch (default: the hardware's inter-group "
                        "bandwidth, else each GPU's share of its node's NICs)")
    p.set_defaults(func=cmd_goodput)

    p = sub.add_parser("report", help="the guide's worked examples, recomputed", formatter_class=_Help)
    _common(p, hardware=False)
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("validate", help="the planner against published FSDP runs (exit 1 outside the band)",
                       description="Predict every published run of zerodp/plan/validation.json as "
                                   "it ran and compare TPS/GPU and memory with what its source "
                                   "measured (docs/planner.md); exits 1 when a run is outside "
                                   "the band.", formatter_class=_Help)
    _common(p, hardware=False)
    p.add_argument("--holdout", action="store_true",
                   help="also fit the compute constants on some runs and predict the others")
    p.add_argument("--fit", action="store_true",
                   help="fit the compute constants on every run first, and use them")
    p.add_argument("--table", metavar="PATH",
                   help="another validation table of the same format (default: the shipped one)")
    p.set_defaults(func=cmd_validate)
