"""An optimizer the script builds over the module's parameters after the wrap (guide §12.9).

A DDP script ports by its wrap line: ``model = DDP(model)`` becomes ``model = zerodp.parallelize(
model, stage=s)``, and the script's next line, ``optimizer = torch.optim.SGD(model.parameters(),
...)``, builds a stock optimizer over the module's parameters — which hold no gradient the engine
would apply, and whose values the engine overwrites from its master at every step. So the engine
watches every stock optimizer's ``step()`` (torch's global step hooks, removed with the engine):

- a ``parallelize`` given no optimizer **adopts** the first one that steps its parameters: its
  class, defaults and param groups are rebuilt over the master (as a built optimizer given to
  ``parallelize`` is, :func:`zerodp.engine.optimizer_plan.from_built`), state it loaded before its first
  step goes in with it, and from then on its ``step()`` is ``engine.step()`` (its own hyper-
  parameters — an LR set by a scheduler — copied to the master first; the stock body then runs
  over no parameters), its ``zero_grad`` ``engine.zero_grad``, its ``state_dict`` and
  ``load_state_dict`` the engine optimizer's (torch's format, full tensors: collective);
- an optimizer over the module's parameters when the engine already has one is refused at its
  first ``step()`` in one line: two optimizers would both claim the parameters.

A per-tensor optimizer (Muon, Adafactor) cannot be adopted: the flat buffers were laid out for
flat shards at ``parallelize`` (guide §12.3); it is refused with the line that says to pass it there.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch.optim import optimizer as torch_optimizer

_PARAMS = "params"


def is_adoption_hook(hook) -> bool:
    """Whether a global optimizer hook is one of these (the engine's own step ignores them)."""
    return getattr(hook, "_zerodp_adoption", False)


class Adoption:
    """One engine's watch over the stock optimizers stepped in its process (module docstring)."""

    def __init__(self, module, engine, pending: bool, given: list = ()):
        self.pending = pending  # parallelize got no optimizer: adopt the first that steps the module
        self._given = {id(o) for o in given}  # built optimizers given to parallelize (take_given)
        self._given_list = list(given)
        self.adopted: torch.optim.Optimizer | None = None
        ref, me = weakref.ref(engine), weakref.ref(self)  # weak: the hooks outlive both (see _sweep)
        self._param_ids = {id(p) for p in module.parameters()}
        self._emptied: dict[int, list] = {}

        def pre(optimizer, args, kwargs):
            eng, adoption = ref(), me()
            return None if eng is None or adoption is None else adoption.before_step(eng, optimizer, args, kwargs)

        def post(optimizer, args, kwargs):
            adoption = me()
            saved = None if adoption is None else adoption._emptied.pop(id(optimizer), None)
            if saved is not None:
                for group, params in zip(optimizer.param_groups, saved):
                    group[_PARAMS] = params

        pre._zerodp_adoption = post._zerodp_adoption = True
        pre._zerodp_gone = post._zerodp_gone = lambda: ref() is None
        _sweep()
        torch_optimizer.register_optimizer_step_pre_hook(pre)
        torch_optimizer.register_optimizer_step_post_hook(post)

    def _holds_module_params(self, optimizer) -> bool:
        return any(id(p) in self._param_ids for g in optimizer.param_groups for p in g[_PARAMS])

    def before_step(self, engine, optimizer, args, kwargs):
        """A stock optimizer is about to step: if it holds this module's parameters, the engine steps
        instead, and the stock body runs over no parameters (its post hook gives them back)."""
        if optimizer is not self.adopted:
            if id(optimizer) in self._given or not self._holds_module_params(optimizer):
                return None
            if not self.pending:
                raise RuntimeError(
                    f"this {type(optimizer).__name__} steps parameters of a model that zerodp.parallelize already gave "
                    "an optimizer: the engine trains its fp32 master, so step engine.optimizer instead (or pass this "
                    "optimizer to parallelize and build none before)")
            self.adopt(engine, optimizer)
        closure = args[1] if len(args) > 1 else kwargs.get("closure")
        if closure is not None:
            with torch.enable_grad():
                closure()
        engine.step()
        self._emptied[id(optimizer)] = [g[_PARAMS] for g in optimizer.param_groups]
        for g in optimizer.param_groups:
            g[_PARAMS] = []
        return (args[0],), {}

    def options_in(self, engine) -> None:
        """Before the engine's step: the taken optimizer's options (an LR set by a scheduler) → the master."""
        if self.adopted is not None:
            _copy_options(self.adopted.param_groups, engine.master.optimizer.param_groups)

    def options_out(self, engine) -> None:
        """After it: what the step moved in the master's groups (a per-group step counter) → the taken optimizer."""
        if self.adopted is not None:
            _copy_options(engine.master.optimizer.param_groups, self.adopted.param_groups)

    def take_given(self, engine) -> None:
        """The one optimizer given to ``parallelize``, rebuilt over the master at construction,
        becomes the engine's as an adopted one does (:meth:`adopt`, without a second rebuild): its
        ``step()`` is ``engine.step()``, state it loaded before the wrap (a resume) goes in with it.
        Its ``param_groups`` keep the module's parameters — whose ``.grad`` is the reduced gradient
        (a :class:`~zerodp.engine.grads.ShardedGrad` at sharded stages), so that clipping over
        ``optimizer.param_groups`` clips as over ``model.parameters()`` — and their options go to the
        master before each step and come back after it: a scheduler built on it, before or after the
        wrap, moves the engine's learning rate. (Several given as a list were rebuilt as one and
        refuse their own ``step()``.)"""
        if len(self._given_list) != 1:
            return
        optimizer = self._given_list.pop()
        self._route(engine, optimizer, _take_state(optimizer))

    def adopt(self, engine, optimizer: torch.optim.Optimizer) -> None:
        """Rebuild ``optimizer`` over the engine's master and route its calls to the engine."""
        saved = _take_state(optimizer)
        engine.adopt_optimizer(optimizer)
        self._route(engine, optimizer, saved)

    def _route(self, engine, optimizer: torch.optim.Optimizer, saved: dict | None) -> None:
        """From here on ``optimizer`` is the engine's: its calls go to the engine, ``saved`` (the
        state it loaded before, torch's format) into the engine's optimizer."""
        self.pending = False
        self.adopted = optimizer
        ref = weakref.ref(engine)

        def state_dict() -> dict:
            return ref().optimizer.state_dict()

        def load_state_dict(state_dict: dict) -> None:  # torch's signature: torch's helpers pass it by name
            ref().optimizer.load_state_dict(state_dict)

        def add_param_group(group: dict) -> None:
            raise RuntimeError(
                f"add_param_group on the {type(optimizer).__name__} that zerodp took over: the engine's buckets, "
                "units and master were planned at parallelize, and a tensor added now would never train; put the "
                "parameter in a param group with lr=0 before parallelize and raise its lr later")

        optimizer.zero_grad = lambda set_to_none=True: _call(ref, "zero_grad", set_to_none)
        optimizer.state_dict = state_dict
        optimizer.load_state_dict = load_state_dict
        optimizer.add_param_group = add_param_group
        optimizer.state = _TakenState(optimizer.state, self._param_ids,
                                      lambda: (e := ref()) is not None and bool(e.master.optimizer.state))
        if saved is not None:
            load_state_dict(saved)


class _TakenState(dict):
    """The ``state`` of an optimizer the engine took over: empty, as its states live on the
    engine's fp32 master; looking up one of the model's parameters says where they are rather than
    returning ``{}`` as torch's defaultdict would. It is true once the engine's optimizer holds
    state, as a stepped optimizer's ``state`` is: torch.distributed.checkpoint's helpers otherwise
    take a step with zero gradients to create it (``_init_optim_state``), which the engine would run."""

    def __init__(self, state: dict, param_ids: set[int], holds: Callable[[], bool]):
        super().__init__(state)
        self._param_ids = param_ids
        self._holds = holds

    def __bool__(self) -> bool:
        return len(self) > 0 or self._holds()

    def __missing__(self, key):
        if id(key) in self._param_ids:
            raise KeyError(
                "this optimizer's state lives on zerodp's fp32 master, not on the model's parameters: read it by "
                "name with engine.optimizer_state_dict()['state'][name] (or optimizer.state_dict(), torch's format)")
        value = self[key] = {}
        return value


def _take_state(optimizer: torch.optim.Optimizer) -> dict | None:
    """State the optimizer loaded before its first step (a resume), in torch's format, taken out
    of it to go into the engine's; None when it holds none."""
    if not optimizer.state:
        return None
    saved = torch.optim.Optimizer.state_dict(optimizer)
    optimizer.state.clear()
    return saved


def _copy_options(src: list[dict], dst: list[dict]) -> None:
    """Each param group's options (lr, weight decay, ...) from ``src`` to ``dst``, in order."""
    for a, b in zip(src, dst):
        b.update({k: v for k, v in a.items() if k != _PARAMS})


def _call(ref, method: str, *args):
    eng = ref()
    if eng is not None:
        return getattr(eng, method)(*args)
    return None


def _sweep() -> None:
    """Remove the global step hooks of engines that are gone. Not from the engine's finalizer: the
    garbage collector may run it inside another optimizer's ``step()``, while torch iterates over
    these hooks (a dict changed during that iteration raises); an engine's construction is a safe
    point, and a gone engine's hooks return at once until then."""
    for hooks in (getattr(torch_optimizer, "_global_optimizer_pre_hooks", {}),
                  getattr(torch_optimizer, "_global_optimizer_post_hooks", {})):
        for key, hook in list(hooks.items()):
            if getattr(hook, "_zerodp_adoption", False) and hook._zerodp_gone():
                del hooks[key]
