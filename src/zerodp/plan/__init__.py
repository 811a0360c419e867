"""zerodp.plan: the guide's cost models as a torch-free library.

Every function takes plain numbers (bytes, seconds, FLOP/s, counts) or dataclasses and returns a
dataclass whose ``to_dict()`` is JSON-ready with documented keys. Bad input raises ValueError.

- hardware:    :class:`Hardware`, presets (H100, H800, H200, A100, B200, TPU v5p), :func:`load_hardware`
- collectives: alpha-beta ring times, algbw/busbw, V* = NαW, two-leg (intra/inter node) times
- memory:      model states per GPU for stages 0–3, activations (Korthikanti et al. 2022), and
               :func:`memory_plan`, the whole bill and the one "fits" every front end shows
- hf:          parameter counts and shapes from a Hugging Face config.json
- roofline:    tokens-per-device threshold, MoE, whole-model and per-layer (FSDP) forms
- hybrid:      past one node (guide §14): shard groups of g, bytes per element on the wire,
               :func:`step_bytes_per_leg` (what the engine measures), :func:`step_comm` by leg
- diloco:      replica groups that talk rarely (guide §16): DiLoCo / Streaming DiLoCo over
               hybrid ZeRO, cross-group bytes per step, outer state, step times and the
               bandwidth below which DiLoCo's step beats hybrid ZeRO's
- goodput:     goodput under node failures: restart every rank from a checkpoint (Young's and
               the best interval) vs heal one replica group from a live peer (issue 52)
- batch:       gbs = mbs × grad_acc × dp
- recommend:   the fastest configuration that fits, ranked (docs/planner.md, "recommend")
- timeline:    bucketed-overlap and FSDP-prefetch event simulation, bucket-size sweep
- models:      model presets (shipped as config.json files) and custom shapes
- compute:     the step's compute on one device (step_compute)
- report:      the guide's worked examples, recomputed
- plot:        timeline lanes and sweep curve (matplotlib imported only when called)
"""

from zerodp.plan.batch import BatchPlan, nearest_power_of_two, plan_batch
from zerodp.plan.collectives import (KINDS, CollectiveTime, HierarchicalCost, RingCost,
                                     bus_factor, collective_time, network_cost, ring_steps)
from zerodp.plan.diloco import (DiLoCoBytes, DiLoCoPlan, DiLoCoSettings, GroupLink,
                                diloco_bytes, diloco_plan, group_link, measured_loss,
                                outer_state_bytes)
from zerodp.plan.goodput import (Goodput, HealGoodput, best_interval, daly_interval,
                                 failure_domains, goodput_plan, goodput_table, heal_goodput,
                                 restart_goodput, young_interval)
from zerodp.plan.hardware import (PRESETS as HARDWARE_PRESETS, Hardware, get_hardware,
                                  hardware_from_dict, hardware_names, load_hardware,
                                  save_hardware, with_inter_group)
from zerodp.plan.hf import load_config, model_from_config, parse_config
from zerodp.plan.hybrid import (COMPRESSIONS, QUANT_BLOCK, StepComm, StepCollective, Wire,
                                hybrid_model_states, int8_bytes, step_bytes_per_leg,
                                step_collectives, step_comm, wire_bytes)
from zerodp.plan.memory import (ADAM_K, PRECISIONS, Activations, MaxParams, MemoryPlan,
                                ModelStates, activations, all_stages, max_params, memory_plan,
                                model_states)
from zerodp.plan.models import PRESETS as MODEL_PRESETS, Model, custom_model, get_model, model_names
from zerodp.plan.plot import plot_timeline
from zerodp.plan.recommend import Candidate, Recommendation, recommend
from zerodp.plan.report import Report, ReportRow, build_report
from zerodp.plan.roofline import (LayerPrefetch, MaxDevices, Roofline, WholeModel, layer_prefetch,
                                  max_devices, threshold, whole_model)
from zerodp.plan.timeline import (DDP_DEFAULT_BUCKET_BYTES, BackwardTimeline, Bucket, BucketRun,
                                  BucketSweep, CommOp, FsdpTimeline, Layer, LayerSpan, SweepPoint,
                                  default_bucket_sizes, model_layers, simulate_backward,
                                  simulate_fsdp, sweep_buckets, uniform_layers)

__all__ = [
    "ADAM_K", "PRECISIONS", "MemoryPlan", "memory_plan", "load_config", "model_from_config",
    "parse_config", "Activations", "BackwardTimeline", "BatchPlan", "Bucket", "BucketRun", "BucketSweep",
    "CollectiveTime", "CommOp", "DDP_DEFAULT_BUCKET_BYTES", "FsdpTimeline", "HARDWARE_PRESETS",
    "Hardware", "HierarchicalCost", "KINDS", "Layer", "LayerPrefetch", "LayerSpan", "MODEL_PRESETS",
    "MaxDevices", "MaxParams", "Model", "ModelStates", "Report", "ReportRow", "RingCost", "Roofline",
    "SweepPoint", "WholeModel", "activations", "all_stages", "build_report", "bus_factor",
    "collective_time", "custom_model", "default_bucket_sizes", "get_hardware", "get_model",
    "hardware_from_dict", "hardware_names", "layer_prefetch", "load_hardware", "max_devices",
    "max_params", "model_layers", "model_names", "model_states", "nearest_power_of_two",
    "network_cost", "plan_batch", "plot_timeline", "ring_steps", "save_hardware", "threshold", "simulate_backward",
    "simulate_fsdp",
    "sweep_buckets", "uniform_layers", "whole_model",
    "COMPRESSIONS", "QUANT_BLOCK", "StepComm", "StepCollective", "Wire", "hybrid_model_states",
    "int8_bytes", "step_bytes_per_leg", "step_collectives", "step_comm", "wire_bytes",
    "Candidate", "Recommendation", "recommend",
    "DiLoCoBytes", "DiLoCoPlan", "DiLoCoSettings", "GroupLink", "diloco_bytes", "diloco_plan",
    "group_link", "measured_loss", "outer_state_bytes", "with_inter_group",
    "Goodput", "HealGoodput", "best_interval", "daly_interval", "failure_domains", "goodput_plan",
    "goodput_table", "heal_goodput", "restart_goodput", "young_interval",
]
