"""``zerodp train``, ``zerodp sample`` and ``zerodp export``."""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields

from zerodp import runconfig
from zerodp.train.config import MIXED_PRECISION_CHOICES, PRESET_NAMES, TrainConfig

_DEFAULTS = TrainConfig()
#: --compress (zerodp plan's names, zerodp.plan.hybrid.COMPRESSIONS) -> (reduce_dtype, quantize)
COMPRESS = {"none": (None, None), "bf16-reduce": ("bf16", None), "int8-params": (None, "params"),
            "int8-grads": (None, "grads"), "int8": (None, "both")}


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except the ones that are None (their help says what None means)."""

    def _get_help_string(self, action):
        if action.default is None or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


def _d(name: str):
    return getattr(_DEFAULTS, name)


def add_parser(sub) -> None:
    _add_train(sub)
    _add_sample(sub)
    _add_export(sub)


def _add_train(sub) -> None:
    p = sub.add_parser(
        "train", help="train a small GPT data-parallel on local ranks (or under torchrun)",
        description="Train a GPT on the bundled English corpus (or --data) with the zerodp engine. "
                    "Starts --nproc local ranks through PyTorch's elastic launcher; under torchrun "
                    "it runs as one of torchrun's workers. Writes metrics, checkpoints and a report "
                    "into --out.",
        formatter_class=_Help)
    g = p.add_argument_group("model and data")
    model = g.add_argument("--model", dest="preset", default=_d("preset"), type=_preset,
                           metavar="{" + ",".join(PRESET_NAMES) + "}", help="the GPT preset to train")
    runconfig.add_alias(g, "--preset", model)
    g.add_argument("--data", default=None, metavar="FILE",
                   help="a text file, or a nanoGPT-style uint16 .bin token file (default: Python's "
                        "bundled documentation topics)")
    g.add_argument("--seq-len", type=int, default=_d("seq_len"), help="tokens per sequence")
    g = p.add_argument_group("batch (guide §6.1: gbs = micro-batch × grad_acc × ranks)")
    g.add_argument("--global-batch-tokens", type=int, default=_d("global_batch_tokens"),
                   help="tokens per optimizer step, over all ranks")
    g.add_argument("--micro-batch", type=int, default=_d("micro_batch"),
                   help="sequences per rank per forward/backward")
    g = p.add_argument_group("parallelism")
    g.add_argument("--nproc", type=int, default=_d("nproc"), help="local ranks to start")
    g.add_argument("--stage", type=int, default=_d("stage"),
                   help="0 DP, 1 ZeRO-1, 2 ZeRO-2, 3 ZeRO-3/FSDP (guide §9)")
    g.add_argument("--mixed-precision", default="fp32", choices=MIXED_PRECISION_CHOICES,
                   help="fp32 throughout, or bf16 (bfloat16) compute with fp32 master weights (guide §1); "
                        "the engine refuses fp16, which needs loss scaling")
    g.add_argument("--bucket-mb", type=_bucket_mb, default=_d("bucket_mb"), metavar="MB|auto",
                   help="gradient bucket size in MiB (guide §4), or auto: the simulator's sweet spot for "
                        "this model and machine, from --profile")
    g.add_argument("--profile", default=None, metavar="FILE",
                   help="calibration profile written by `zerodp calibrate` on --nproc ranks (for "
                        "--bucket-mb auto)")
    g.add_argument("--plan", default=None, choices=["auto"],
                   help="auto: calibrate this machine (unless --profile), ask zerodp plan recommend for "
                        "the fastest stage and micro-batch at this global batch, train its top 3 for a "
                        "few steps each, print predicted vs measured and the regret, then train with "
                        "the measured best (OUT/plan-auto.json keeps the table)")
    g.add_argument("--shard-size", type=int, default=None, metavar="G",
                   help="hybrid sharding (guide §14): stages 1-3 shard inside groups of G ranks and "
                        "replicate across them (default: one node, torchrun's LOCAL_WORLD_SIZE)")
    g.add_argument("--replica-groups", type=int, default=None, metavar="R",
                   help="R replica groups of --nproc ranks that survive a failure (zerodp.ft, torchft): each "
                        "group a job of its own; a killed group is started again (--max-restarts) and heals "
                        "from a live peer while the others step on (docs/reliability.md)")
    g.add_argument("--diloco-every", type=int, default=None, metavar="H",
                   help="DiLoCo (guide §16): the --shard-size groups train alone and average their "
                        "pseudo-gradients every H steps (outer Nesterov SGD, lr 0.7, momentum 0.9); "
                        "needs at least two groups")
    g.add_argument("--diloco-fragments", type=int, default=_d("diloco_fragments"), metavar="F",
                   help="Streaming DiLoCo: sync the model in F fragments at staggered steps (F <= H)")
    g.add_argument("--diloco-compress", default="none", choices=["none", "int8"],
                   help="the pseudo-gradients on the wire: fp32, or blockwise int8 (1 + 4/256 bytes each)")
    g.add_argument("--diloco-delay", type=int, default=_d("diloco_delay"), metavar="TAU",
                   help="a fragment's exchange runs behind TAU inner steps and its update lands then (TAU < H)")
    g.add_argument("--diloco-lr", type=float, default=_d("diloco_lr"), metavar="LR",
                   help="the outer SGD's learning rate")
    g.add_argument("--diloco-momentum", type=float, default=_d("diloco_momentum"), metavar="MU",
                   help="the outer SGD's Nesterov momentum (0 with --diloco-lr 1: the groups' mean, local SGD)")
    g.add_argument("--compress", default="none", choices=list(COMPRESS),
                   help="bytes on the wire, as zerodp plan names them (guide §15): bf16-reduce: "
                        "gradients travel and are reduced in bf16; int8-params / int8-grads / int8: "
                        "int8 parameter AllGather and/or gradient reduction, stages 1-3")
    # the old spellings, kept hidden: --reduce-dtype bf16 is --compress bf16-reduce, --quantize
    # params|grads|both is --compress int8-params|int8-grads|int8
    g.add_argument("--reduce-dtype", default=None, choices=["bf16"], help=argparse.SUPPRESS)
    g.add_argument("--quantize", default=None, choices=["params", "grads", "both"],
                   help=argparse.SUPPRESS)
    g.add_argument("--backend", default=_d("backend"), choices=["auto", "gloo", "nccl"],
                   help="torch.distributed backend (auto: nccl with CUDA, else gloo)")
    g.add_argument("--max-restarts", type=int, default=_d("max_restarts"),
                   help="restart the group this often after a rank fails (resumes from the newest checkpoint)")
    g.add_argument("--timeout-s", type=float, default=_d("timeout_s"),
                   help="how long a rank waits for the others in a collective before it gives up; a "
                        "rank that makes no progress for 1.5x this (+2 s) is ended by its watchdog")
    g.add_argument("--grace-s", type=float, default=_d("grace_s"),
                   help="on SIGTERM or a first Ctrl-C every rank finishes its step, saves a checkpoint "
                        "and stops within this many seconds (exit status 143 or 130; a second Ctrl-C "
                        "aborts at once); under torchrun give it --shutdown-timeout at least this")
    g.add_argument("--on-save-error", default=_d("on_save_error"), choices=["stop", "continue"],
                   help="when the filesystem refuses a checkpoint (full disk, no permission, I/O "
                        "error): stop (exit status 74) or continue and retry at the next --ckpt-every")
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int, default=_d("steps"), help="optimizer steps in all")
    g.add_argument("--stop-after", type=int, default=None, metavar="N",
                   help="end this invocation after N steps with a checkpoint (continue with --resume)")
    g.add_argument("--lr", type=float, default=_d("lr"), help="peak learning rate (AdamW)")
    g.add_argument("--min-lr-ratio", type=float, default=_d("min_lr_ratio"),
                   help="final learning rate of the cosine decay, as a fraction of --lr")
    g.add_argument("--warmup-steps", type=int, default=_d("warmup_steps"),
                   help="steps of linear learning-rate warm-up before the cosine decay")
    g.add_argument("--weight-decay", type=float, default=_d("weight_decay"),
                   help="AdamW weight decay")
    g.add_argument("--clip", type=float, default=_d("clip"), help="gradient-norm clipping threshold")
    g.add_argument("--seed", type=int, default=_d("seed"), help="initial weights and data order")
    g.add_argument("--max-skipped-steps", type=int, default=_d("max_skipped_steps"), metavar="N",
                   help="a step whose gradients hold inf/NaN on any rank is skipped on every rank; "
                        "training stops after N such steps in a row")
    g = p.add_argument_group("outputs")
    g.add_argument("--out", default=None, metavar="DIR", help="run directory (default: runs/<time>)")
    g.add_argument("--eval-every", type=int, default=_d("eval_every"),
                   help="steps between validation losses (0: end only)")
    g.add_argument("--eval-batches", type=int, default=_d("eval_batches"), help="validation micro-batches per rank")
    g.add_argument("--ckpt-every", type=int, default=_d("ckpt_every"), help="steps between checkpoints (0: end only)")
    g.add_argument("--keep-checkpoints", type=int, default=_d("keep_checkpoints"),
                   help="newest complete checkpoints kept on disk; older ones are deleted")
    g.add_argument("--resume", nargs="?", const="", default=None, metavar="CKPT",
                   help="continue from a checkpoint directory or a run directory's newest checkpoint "
                        "(no value: the one in --out)")
    g.add_argument("--trace", action="store_true", help="write the Chrome trace of one step (trace.json)")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile the model (in place, before parallelize; inductor on CUDA, aot_eager on "
                        "CPU); the engine's hooks stay outside the graphs (docs/engine.md, torch.compile)")
    g.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress output (default: a bar on a terminal; elsewhere, in pipes, CI and "
                        "relayed output, one line per --progress-every steps or --progress-every-s seconds)")
    g.add_argument("--progress-every", type=int, default=_d("progress_every"), metavar="N",
                   help="without a terminal: a progress line every N steps (0: a twentieth of the run)")
    g.add_argument("--progress-every-s", type=float, default=_d("progress_every_s"), metavar="S",
                   help="without a terminal: a progress line at least every S seconds")
    g.add_argument("--tensorboard", action="store_true",
                   help="also write TensorBoard events into OUT/tensorboard (pip install 'zerodp[tensorboard]')")
    runconfig.add_config_options(p, "zerodp train")
    p.set_defaults(func=run_train, _config_check=config_from_args)


def _preset(name: str) -> str:
    """``--preset``: a GPT this trainer builds; a planner-only model is named as such."""
    if name in PRESET_NAMES:
        return name
    from zerodp.plan.models import model_names

    if name in model_names(trainable=False):
        raise argparse.ArgumentTypeError(
            f"{name} is a planner-only model (zerodp plan memory --model {name}); zerodp train "
            f"builds {', '.join(PRESET_NAMES)}")
    raise argparse.ArgumentTypeError(f"unknown preset {name!r}; choose one of {', '.join(PRESET_NAMES)}")


def _bucket_mb(text: str) -> float | str:
    """``--bucket-mb``: ``auto`` or a number (its sign is checked by TrainConfig)."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of MiB or 'auto', got {text!r}") from None


def _compress(args) -> None:
    """``--compress`` into the config's reduce_dtype/quantize; the hidden old spellings into
    ``--compress`` (so OUT/config.toml names what ran), one line when both are given."""
    compress = getattr(args, "compress", "none") or "none"
    old = (getattr(args, "reduce_dtype", None), getattr(args, "quantize", None))
    if compress != "none":
        if old != (None, None) and old != COMPRESS[compress]:
            raise ValueError(f"--compress {compress} and --reduce-dtype/--quantize disagree: give "
                             "--compress alone")
        args.reduce_dtype, args.quantize = COMPRESS[compress]
    elif old != (None, None):
        args.compress = next((k for k, v in COMPRESS.items() if v == old), "none")


def config_from_args(args) -> TrainConfig:
    _compress(args)
    names = {f.name for f in fields(TrainConfig)}
    kw = {k: v for k, v in vars(args).items() if k in names}
    if kw.get("resume") == "":
        if not kw.get("out"):
            raise ValueError("--resume without a checkpoint needs --out DIR (the run to continue)")
        kw["resume"] = kw["out"]
    return TrainConfig(**kw)


def run_train(args) -> int:
    from dataclasses import replace

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from zerodp.train.checkpoint import resume_hint
    from zerodp.train.launch import Stopped, default_out, launch, launched_by_torchrun

    cfg = config_from_args(args)
    if cfg.out is None and not launched_by_torchrun():
        cfg = replace(cfg, out=default_out())
    if cfg.replica_groups is not None:  # zerodp.ft: the lighthouse and R groups, or one rank of one
        from zerodp.ft.app import run

        if cfg.out is not None:
            keep_config(args, cfg)
        return run(cfg)
    if cfg.plan == "auto":
        cfg = _plan_auto(args, cfg, launched_by_torchrun())
        if cfg is None:
            return 2
    try:
        out = launch(cfg, before_start=lambda c: keep_config(args, c))
    except Stopped as e:  # SIGTERM / Ctrl-C, or a checkpoint the filesystem refused
        if str(e):
            print(f"\n{e}", file=sys.stderr)
        return e.code
    except (KeyboardInterrupt, SignalException):
        print(f"\nzerodp train: interrupted. {resume_hint(cfg.out)}", file=sys.stderr)
        return 130
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        message, callstack = describe_failure(failure)
        if callstack:
            print(callstack, file=sys.stderr)
        print(f"zerodp train: rank {rank} failed (exit code {failure.exitcode}): {message}. "
              f"{resume_hint(cfg.out)}", file=sys.stderr)
        return 1
    if out:
        print(f"\nrun directory: {out}", file=sys.stderr)
    return 0


def _plan_auto(args, cfg: TrainConfig, under_torchrun: bool) -> TrainConfig | None:
    """``--plan auto`` (:mod:`zerodp.train.autoplan`): the config with the measured best layout,
    also written into ``args`` so that OUT/config.toml repeats the chosen run (None: refused, the
    reason printed in one line)."""
    from dataclasses import replace
    from pathlib import Path

    from zerodp.train import autoplan
    from zerodp.train.launch import validate

    why = autoplan.refuse(cfg, under_torchrun)
    if why is None:
        try:
            # bad input ends here, before calibration and the trial (the micro-batch is the plan's)
            validate(replace(cfg, micro_batch=1), cfg.nproc)
        except ValueError as e:
            why = str(e)
    if why is not None:
        print(f"zerodp train: error: {why}", file=sys.stderr)
        return None
    chosen, record = autoplan.choose(cfg, Path(cfg.out), say=lambda m: print(m, flush=True))
    print(f"plan auto: training with {record['chosen']['layout']}", flush=True)
    args.stage, args.micro_batch, args.bucket_mb, args.profile = (
        chosen.stage, chosen.micro_batch, chosen.bucket_mb, chosen.profile)
    args.plan = None
    return chosen


def keep_config(args, cfg: TrainConfig) -> None:
    """Write the run's resolved settings to OUT/config.toml (rank 0 only under torchrun): the
    file ``zerodp train --config`` reads to run it again."""
    import os

    if cfg.out is None or int(os.environ.get("RANK", "0")) != 0:
        return
    saved = argparse.Namespace(**vars(args))
    saved.out = cfg.out
    runconfig.write(saved, os.path.join(cfg.out, runconfig.CONFIG_FILE))


# Failures whose message says everything: no traceback from inside the engine or the backend.
EXPLAINED_ERRORS = ("CollectiveFailure", "NonFiniteGradients", "CheckpointError", "ValueError",
                    "FileNotFoundError", "CheckpointWriteError")


def describe_failure(failure) -> tuple[str, str]:
    """A failed worker (torch.distributed.elastic's ``ProcessFailure``) in words, and the Python
    traceback to show with it ("" when the error explains itself or there is none)."""
    from zerodp.train.watchdog import WATCHDOG_EXIT_CODE

    message = failure.message
    if isinstance(message, dict):  # the worker raised: @record wrote its error file
        text = str(message.get("message", ""))
        callstack = message.get("extraInfo", {}).get("py_callstack", "")
        return text, "" if text.split(":", 1)[0] in EXPLAINED_ERRORS else callstack
    if failure.exitcode is not None and failure.exitcode < 0:
        return f"it was killed by signal {failure.signal_name()}", ""
    if failure.exitcode == WATCHDOG_EXIT_CODE:
        return ("its watchdog ended it: it made no progress within the time --timeout-s allows "
                "(its output above says where it was stuck)"), ""
    return ("its process ended without a Python error (a crash, os._exit, or the out-of-memory "
            "killer); its output above may say more"), ""


def _add_sample(sub) -> None:
    p = sub.add_parser("sample", help="print text generated by a trained model",
                       description="Generate text from a checkpoint (a checkpoint directory, a run "
                                   "directory = its newest checkpoint, or a file from zerodp export). "
                                   "Runs in one process; no engine needed.",
                       formatter_class=_Help)
    p.add_argument("checkpoint", metavar="CKPT",
                   help="checkpoint directory, run directory or exported .safetensors file")
    p.add_argument("--prompt", default="The ", help="text to continue")
    new = p.add_argument("--max-new-tokens", dest="tokens", type=int, default=300,
                         help="tokens (bytes) to generate, >= 1")
    runconfig.add_alias(p, "--tokens", new)
    p.add_argument("--temperature", type=_bounded(float, "temperature", 0, 100, low_open=True),
                   default=0.8, help="sampling temperature, > 0 (lower: more predictable)")
    p.add_argument("--top-k", type=_bounded(int, "top-k", 1, 1_000_000), default=40,
                   help="sample among the k likeliest next tokens, >= 1")
    p.add_argument("--seed", type=int, default=0, help="random seed of the sampling")
    p.set_defaults(func=run_sample)


def _bounded(kind, name: str, low: float, high: float, low_open: bool = False):
    """An argparse type: a ``kind`` number in [low, high] ((low, high] with ``low_open``), or one
    sentence that names the option and the range."""
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{name} must be {'a whole number' if kind is int else 'a number'}, got {text!r}") from None
        if v != v or v > high or v < low or (low_open and v == low):
            lo = f"> {low:g}" if low_open else f">= {low:g}"
            raise argparse.ArgumentTypeError(f"{name} must be {lo} and <= {high:,}, got {text!r}")
        return v
    parse.__name__ = name
    return parse


def _existing(path: str) -> str:
    """``path`` when it exists; otherwise the one-line error now, before PyTorch loads (seconds)."""
    import os

    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    return path


def run_sample(args) -> int:
    _existing(args.checkpoint)
    from zerodp.train.export import sample

    text = sample(args.checkpoint, prompt=args.prompt, tokens=args.tokens,
                  temperature=args.temperature, top_k=args.top_k, seed=args.seed,
                  log=lambda m: print(m, file=sys.stderr))
    print(text)
    return 0


def _add_export(sub) -> None:
    p = sub.add_parser("export", help="write a checkpoint as a plain state_dict, a Hugging Face directory or DCP",
                       description="Assemble the full fp32 parameters from a sharded checkpoint (any "
                                   "world size, any stage). --format safetensors (default): one "
                                   "safetensors state_dict that GPT(cfg).load_state_dict("
                                   "safetensors.torch.load_file(OUT)) loads. --format hf: a Hugging Face "
                                   "directory OUT (model-0000i-of-0000N.safetensors + "
                                   "model.safetensors.index.json, keyed by the model's own names). "
                                   "--format dcp: a torch.distributed.checkpoint directory OUT.",
                       formatter_class=_Help)
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory or run directory")
    p.add_argument("output", metavar="OUT",
                   help="the .safetensors file (--format safetensors) or the directory (hf, dcp) to write")
    p.add_argument("--format", choices=("safetensors", "hf", "dcp"), default="safetensors",
                   help="what to write")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="floating-point dtype of the written tensors (--format hf only; default float32)")
    p.add_argument("--max-shard-mb", type=_bounded(float, "max-shard-mb", 0, 1e9, low_open=True), default=None,
                   help="largest safetensors shard in MB of 10^6 bytes (--format hf only; default 5000, as "
                        "save_pretrained's 5GB)")
    p.set_defaults(func=run_export)


def run_export(args) -> int:
    _existing(args.checkpoint)
    from zerodp.train import export as ex

    log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    if args.format != "hf":
        for flag, value in (("--dtype", args.dtype), ("--max-shard-mb", args.max_shard_mb)):
            if value is not None:
                raise ValueError(f"{flag} applies to --format hf only; leave it out for --format {args.format}")
    if args.format == "hf":
        shard = None if args.max_shard_mb is None else max(1, int(args.max_shard_mb * 10**6))
        out = ex.export_hf(args.checkpoint, args.output, dtype=args.dtype or "float32", max_shard_bytes=shard,
                           log=log)
    elif args.format == "dcp":
        out = ex.export_dcp_dir(args.checkpoint, args.output, log=log)
    else:
        out = ex.export(args.checkpoint, args.output, log=log)
    print(f"wrote {out}")
    return 0
