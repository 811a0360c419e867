"""``zerodp plan memory|comm|roofline|batch|simulate|report``: the planner on the command line.

Every subcommand prints a table with units, or with ``--json`` the result's ``to_dict()``, and
accepts ``--hardware NAME_OR_FILE`` (a preset or a TOML/JSON hardware file).
"""

from __future__ import annotations

import argparse
import json

from zerodp.plan._common import (GB, MB, fmt_bytes, fmt_count, fmt_time, parse_quantity, table)
from zerodp.plan.batch import plan_batch
from zerodp.plan.collectives import KINDS, RingCost, collective_time, network_cost
from zerodp.plan.hardware import get_hardware, hardware_names
from zerodp.plan.memory import ADAM_K, RECOMPUTE, activations, all_stages, max_params, model_states
from zerodp.plan.models import custom_model, get_model, model_names
from zerodp.plan.report import build_report
from zerodp.plan.roofline import max_devices, threshold
from zerodp.plan.timeline import model_layers, simulate_backward, simulate_fsdp, sweep_buckets

DEFAULT_HARDWARE = "H100"


def _qty(what):
    def parse(text):
        try:
            return parse_quantity(text, what)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    parse.__name__ = what
    return parse


def _int_qty(what):
    def parse(text):
        v = _qty(what)(text)
        if not float(v).is_integer():
            raise argparse.ArgumentTypeError(f"{what} must be a whole number, got {text!r}")
        return int(v)
    parse.__name__ = what
    return parse


def _common(p, model=False):
    p.add_argument("--hardware", default=DEFAULT_HARDWARE, metavar="NAME_OR_FILE",
                   help=f"preset ({', '.join(hardware_names())}) or a .toml/.json hardware file "
                        f"(default {DEFAULT_HARDWARE})")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    if model:
        g = p.add_argument_group("model (a preset, or --params and/or a shape)")
        g.add_argument("--model", metavar="NAME", help=f"one of {', '.join(model_names())}")
        g.add_argument("--params", type=_qty("params"), help="parameter count, e.g. 8e9 or 70G")
        for name in ("layers", "hidden", "heads", "ffn", "vocab"):
            g.add_argument(f"--{name}", type=_int_qty(name))


def _model(args, default=None):
    shape = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "ffn", "vocab")}
    if args.params is not None or (args.model is None and any(v is not None for v in shape.values())):
        if args.model is not None:
            raise ValueError("give either --model or --params/shape, not both")
        return custom_model(params=args.params, **shape)
    if args.model is not None and any(v is not None for v in shape.values()):
        raise ValueError("--model fixes the shape; drop --layers/--hidden/... or use --params instead")
    name = args.model or default
    if name is None:
        raise ValueError(f"give --model ({', '.join(model_names())}) or --params")
    return get_model(name)


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
    model = _model(args, default="zero-7.5b")
    unit = model.block_params or 0.0
    stages = all_stages(model.params, args.gpus, args.k, args.fp32_grad_acc, unit, model.layers)
    if args.stage is not None:
        stages = [s for s in stages if s.stage == args.stage]
    act = None
    if args.seq:
        model.require_shape("layers", "hidden", "heads")
        act = activations(model.layers, model.hidden, model.heads, args.seq, args.mbs, model.ffn,
                          model.vocab or 0, args.recompute)
    limit = max_params(hw.hbm_bytes, args.bytes_per_param) if args.bytes_per_param else None
    extra = act.total_bytes if act else 0.0
    result = {"model": model.to_dict(), "hardware": hw.to_dict(), "n": args.gpus,
              "stages": [s.to_dict() for s in stages],
              "activations": act.to_dict() if act else None,
              "fits": {s.stage_name: s.total_bytes + extra <= hw.hbm_bytes for s in stages},
              "max_params": limit.to_dict() if limit else None}
    rows = [[s.stage_name, _gb(s.param_bytes), _gb(s.grad_bytes), _gb(s.optimizer_bytes),
             _gb(s.grad_acc_bytes), _gb(s.gathered_unit_bytes), _gb(s.model_state_bytes),
             _gb(s.total_bytes + extra),
             "yes" if s.total_bytes + extra <= hw.hbm_bytes else "no"] for s in stages]
    lines = [table(["stage", "params GB", "grads GB", "optim GB", "fp32 acc GB", "gathered GB",
                    "states GB", "total GB", f"fits {hw.hbm_bytes / GB:.3g} GB"], rows,
                   title=f"Memory per GPU: {model.name}, Ψ = {fmt_count(model.params)}, N = {args.gpus}, "
                         f"k = {args.k:g}, fp32 grad accumulation: {'yes' if args.fp32_grad_acc else 'no'}"
                         f" ({hw.name})")]
    if act:
        lines.append(f"activations (Korthikanti et al. 2022, recompute={act.recompute}, seq {act.seq}, "
                     f"micro-batch {act.micro_batch}): {fmt_bytes(act.per_layer_bytes)} per layer, "
                     f"{fmt_bytes(act.total_bytes)} in all (included in 'total GB')")
    if limit:
        lines.append(f"largest model at {args.bytes_per_param:g} bytes/param in {fmt_bytes(hw.hbm_bytes)}: "
                     f"{fmt_count(limit.max_params)} parameters")
    return _emit(args, result, "\n".join(lines))


def cmd_comm(args) -> int:
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
                 title=f"{fmt_bytes(args.bytes)} on {args.gpus} ranks ({where}); a collective takes "
                       "as long as its slower leg (*)")
    return _emit(args, {"results": [r.to_dict() for r in results]}, text)


def cmd_roofline(args) -> int:
    moe = dict(model=args.model, experts=args.experts, experts_per_token=args.top_k)
    if args.model is None:
        moe.pop("model")
    r = threshold(args.hardware, args.gpus, args.axes, **moe)
    result = {"threshold": r.to_dict(), "max_devices": None}
    rows = [["C/W inside a node (uncorrected)", f"{r.intra_c_over_w:,.0f}", "tokens/device"],
            ["C/W across nodes (uncorrected)",
             "-" if r.inter_c_over_w is None else f"{r.inter_c_over_w:,.0f}", "tokens/device"],
            ["(g-1)/g, (m-1)/m", f"{r.intra_factor:.3f}, " + (
                "-" if r.inter_factor is None else f"{r.inter_factor:.3f}"), ""],
            [f"dense threshold ({r.bottleneck} leg)", f"{r.dense_threshold_tokens:,.0f}", "tokens/device"],
            ["MoE factor E/k", f"{r.moe_factor:g}", "x"],
            ["threshold", f"{r.threshold_tokens:,.0f}", "tokens/device"]]
    if r.min_batch_tokens is not None:
        rows.append([f"min global batch on {r.n}", fmt_count(r.min_batch_tokens), "tokens"])
    if args.batch_tokens:
        m = max_devices(args.hardware, args.batch_tokens, args.axes, **moe)
        result["max_devices"] = m.to_dict()
        rows.append([f"max devices for {fmt_count(args.batch_tokens)} tokens", f"{m.max_devices:,}", "devices"])
    where = "at scale (many nodes)" if args.gpus is None else f"on {args.gpus} devices"
    text = table(["quantity", "value", "unit"], rows, align="lrl",
                 title=f"DP/FSDP roofline, {r.hardware} {where}, {args.axes} axis(es): "
                       "compute-bound iff tokens/device > threshold")
    return _emit(args, result, text)


def cmd_batch(args) -> int:
    b = plan_batch(args.tokens, args.seq, args.mbs, args.gpus, not args.no_round)
    rows = [["global batch", f"{b.samples:,}", "samples"],
            ["global batch", fmt_count(b.global_batch_tokens), "tokens"],
            ["micro-batch", b.micro_batch, "samples/GPU"], ["dp", b.dp, "GPUs"],
            ["grad_acc", b.grad_acc, f"steps (exact {b.exact_grad_acc:.3g})"],
            ["processed per step", f"{b.effective_samples:,}", "samples"]]
    text = table(["quantity", "value", "unit"], rows, align="lrl",
                 title="gbs = mbs x grad_acc x dp (seed §6.1)")
    if b.warnings:
        text += "\n" + "\n".join("warning: " + w for w in b.warnings)
    return _emit(args, b.to_dict(), text)


def cmd_simulate(args) -> int:
    hw = get_hardware(args.hardware)
    model = _model(args, default="llama3-8b")
    layers = model_layers(model, hw, args.tokens_per_gpu, args.efficiency)
    if args.bandwidth is not None:
        cost = (RingCost.from_latency(args.latency, args.bandwidth, args.gpus) if args.latency is not None
                else RingCost(args.alpha or 0.0, args.bandwidth, args.gpus))
    else:
        if args.alpha is not None or args.latency is not None:
            raise ValueError("--alpha/--latency need --bandwidth (a flat ring); or change --hardware")
        cost = network_cost(hw, args.gpus)
    head = (f"{model.name} on {args.gpus}x{hw.name}, {args.tokens_per_gpu:g} tokens/GPU, "
            f"{len(layers)} layers, {fmt_bytes(sum(l.param_bytes for l in layers))} of gradients")
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
        return _emit(args, {"fsdp": f.to_dict(), "sweep": None}, text)
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
    return _emit(args, {"timeline": t.to_dict(), "sweep": sweep.to_dict() if sweep else None}, text)


def cmd_report(args) -> int:
    r = build_report()
    return _emit(args, r.to_dict(), r.text())


# ---------------------------------------------------------------------------------------------
def add_parser(subparsers) -> None:
    plan = subparsers.add_parser("plan", help="the seed's cost models: memory, comm, roofline, "
                                 "batch, simulate, report",
                                 description="Plan data-parallel training with the seed's cost models.")
    sub = plan.add_subparsers(dest="plan_command", metavar="SUBCOMMAND")
    plan.set_defaults(func=lambda a: (plan.print_help(), 2)[1])

    p = sub.add_parser("memory", help="model states (and activations) per GPU for stages 0-3")
    _common(p, model=True)
    p.add_argument("--gpus", type=_int_qty("gpus"), default=64, help="data-parallel GPUs N (default 64)")
    p.add_argument("--stage", type=int, choices=[0, 1, 2, 3], help="one stage (default: all)")
    p.add_argument("--k", type=float, default=ADAM_K, help="optimizer bytes per parameter (Adam: 12)")
    p.add_argument("--fp32-grad-acc", action="store_true", help="add the fp32 gradient accumulation buffer")
    p.add_argument("--seq", type=_int_qty("seq"), help="add activations for this sequence length")
    p.add_argument("--mbs", type=_int_qty("mbs"), default=1, help="micro-batch size (default 1)")
    p.add_argument("--recompute", choices=RECOMPUTE, default="none")
    p.add_argument("--bytes-per-param", type=float, help="also print the largest model at this many bytes/param")
    p.set_defaults(func=cmd_memory)

    p = sub.add_parser("comm", help="AllReduce/ReduceScatter/AllGather time (alpha-beta, ring, two legs)")
    _common(p)
    p.add_argument("--bytes", type=_qty("bytes"), required=True, help="V, e.g. 16e9 or 25MB")
    p.add_argument("--gpus", type=_int_qty("gpus"), default=8, help="ranks N (default 8)")
    p.add_argument("--collective", default="all", choices=["all", *KINDS])
    p.add_argument("--alpha", type=float, help="flat ring: seconds per ring step (with --bandwidth)")
    p.add_argument("--latency", type=float, help="flat ring: small-message AllReduce latency α′, s")
    p.add_argument("--bandwidth", type=_qty("bandwidth"), help="flat ring: bytes/s per rank, one way")
    p.set_defaults(func=cmd_comm)

    p = sub.add_parser("roofline", help="tokens per GPU to stay compute-bound; min batch; max GPUs")
    _common(p)
    p.add_argument("--gpus", type=_int_qty("gpus"), help="devices (default: at scale, many nodes)")
    p.add_argument("--axes", type=int, default=1, help="mesh axes doing DP (TPU v5p: up to 3)")
    p.add_argument("--model", help=f"MoE factor from a preset ({', '.join(model_names())})")
    p.add_argument("--experts", type=int, default=1, help="MoE: experts E")
    p.add_argument("--top-k", type=int, default=1, help="MoE: experts per token k")
    p.add_argument("--batch-tokens", type=_qty("batch tokens"), help="also: most devices for this batch")
    p.set_defaults(func=cmd_roofline)

    p = sub.add_parser("batch", help="samples and grad_acc from a global batch in tokens (seed §6.1)")
    _common(p)
    p.add_argument("--tokens", type=_qty("tokens"), required=True, help="target global batch, e.g. 4Mi")
    p.add_argument("--seq", type=_int_qty("seq"), required=True)
    p.add_argument("--mbs", type=_int_qty("mbs"), required=True, help="largest micro-batch that fits")
    p.add_argument("--gpus", type=_int_qty("gpus"), required=True, help="dp")
    p.add_argument("--no-round", action="store_true", help="do not round samples to a power of two")
    p.set_defaults(func=cmd_batch)

    p = sub.add_parser("simulate", help="event simulation of bucketed overlap or FSDP prefetch")
    _common(p, model=True)
    p.add_argument("--gpus", type=_int_qty("gpus"), default=8, help="data-parallel GPUs (default 8)")
    p.add_argument("--tokens-per-gpu", type=_qty("tokens per GPU"), default=4096.0)
    p.add_argument("--bucket", type=_qty("bucket"), default=25e6, help="bucket size in bytes (default 25MB)")
    p.add_argument("--efficiency", type=float, default=1.0, help="fraction of peak FLOP/s reached")
    p.add_argument("--whole-layers", action="store_true", help="close buckets only at layer boundaries")
    p.add_argument("--sweep", action="store_true", help="also sweep bucket sizes")
    p.add_argument("--fsdp", action="store_true", help="ZeRO-3/FSDP: per-unit AllGather + ReduceScatter")
    p.add_argument("--no-prefetch", action="store_true", help="FSDP without prefetch")
    p.add_argument("--alpha", type=float, help="flat ring: seconds per ring step (with --bandwidth)")
    p.add_argument("--latency", type=float, help="flat ring: small-message AllReduce latency α′, s")
    p.add_argument("--bandwidth", type=_qty("bandwidth"), help="flat ring: bytes/s per rank, one way")
    p.add_argument("--plot", metavar="FILE.png", help="draw the timeline (and sweep) to a PNG")
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("report", help="the seed's worked examples, recomputed")
    _common(p)
    p.set_defaults(func=cmd_report)
