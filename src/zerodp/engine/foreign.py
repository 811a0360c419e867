"""Other wrappers' calls on the model, asked of the engine (docs/porting.md, From DDP and From FSDP2).

A script ported by the wrap line still calls what DDP's wrapper or FSDP2's ``FSDPModule`` offered
on the model. The engine has no method for them; ``StageEngine.__getattr__`` asks :func:`answer`,
after the engine's own names and the wrapped model's:

- FSDP2's ``set_requires_gradient_sync(flag)`` is served: it sets DDP's
  ``require_backward_grad_sync``, which ``no_sync()`` sets (guide §5);
- DDP's ``join()`` and ``register_comm_hook(state, hook)`` are there, as on DDP, and refuse in one
  line when called, naming what to do instead (guide §15 for the hooks);
- FSDP2's tuning calls (:data:`FSDP2_CALLS`) are not there (``hasattr`` is False): asking for one
  raises an ``AttributeError`` naming what does its work here.
"""

from __future__ import annotations

from typing import Callable

#: FSDP2's calls with no counterpart, and what does their work here
FSDP2_CALLS = {
    "unshard": "stage 3 gathers each unit in its forward, one unit ahead (prefetch=True); to read whole "
               "parameters, `with model.gathered():`",
    "reshard": "stage 3 frees each unit after its forward and its backward; `with model.gathered():` for whole "
               "parameters",
    "set_reshard_after_forward": "stage=2 keeps every parameter whole (there is no per-unit choice)",
    "set_reshard_after_backward": "stage=2 keeps every parameter whole (there is no per-unit choice)",
    "set_modules_to_forward_prefetch": "prefetch=True (the default) gathers one unit ahead",
    "set_modules_to_backward_prefetch": "prefetch=True (the default) gathers one unit ahead",
    "set_is_last_backward": "a backward outside no_sync() reduces; use model.set_requires_gradient_sync(...)",
    "set_requires_all_reduce": "the cross-group AllReduce of hybrid sharding follows no_sync() / "
                               "model.set_requires_gradient_sync(...) too",
    "set_gradient_divide_factor": "gradients are averaged over the ranks: scale the loss instead",
    "set_reduce_scatter_divide_factor": "gradients are averaged over the ranks: scale the loss instead",
    "set_unshard_in_backward": "stage 3 gathers each unit again before its backward",
}

#: DDP's stock communication hooks, and the option that does their work
_HOOKS = {"bf16_compress_hook": "reduce_dtype='bf16'", "bf16_compress_wrapper": "reduce_dtype='bf16'",
          "fp16_compress_hook": "reduce_dtype='bf16' (fp16 is refused: it needs loss scaling)",
          "fp16_compress_wrapper": "reduce_dtype='bf16' (fp16 is refused: it needs loss scaling)",
          "allreduce_hook": "nothing: it is what the engine does",
          "powerSGD_hook": "quantize_grads=True at stages 1-3 (int8, guide §15)",
          "batched_powerSGD_hook": "quantize_grads=True at stages 1-3 (int8, guide §15)"}


def join(*args, **kwargs):
    """torch DDP's ``join()`` for uneven inputs has no counterpart: refused in one line."""
    raise NotImplementedError(
        "join() (DDP's uneven inputs) is not supported: a rank out of batches would leave the others waiting "
        "in their collectives; give every rank the same number of batches per epoch (DistributedSampler("
        "..., drop_last=True), or drop the last uneven batch on every rank)")


def register_comm_hook(state, hook) -> None:
    """torch DDP's communication hooks have no counterpart; the one line names the option that
    does what torch's stock hook did (guide §15)."""
    name = getattr(hook, "__name__", repr(hook))
    raise NotImplementedError(f"register_comm_hook({name}): communication hooks are not supported; pass "
                              f"{_HOOKS.get(name, 'reduce_dtype= or quantize_grads= (guide §15)')} to "
                              "zerodp.parallelize instead")


def answer(engine, name: str) -> Callable | None:
    """What ``engine.<name>`` is when neither the engine nor its model has it (module docstring)."""
    if name == "set_requires_gradient_sync":
        def set_requires_gradient_sync(requires_gradient_sync: bool, *, recurse: bool = True) -> None:
            engine.require_backward_grad_sync = requires_gradient_sync
        return set_requires_gradient_sync
    if name in ("join", "register_comm_hook"):
        return join if name == "join" else register_comm_hook
    if name in FSDP2_CALLS:
        raise AttributeError(f"{type(engine).__name__} has no {name}() (FSDP2's): {FSDP2_CALLS[name]} "
                             "(docs/porting.md, From FSDP2)")
    return None
