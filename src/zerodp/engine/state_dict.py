"""Standard state dicts for every stage, keyed by the model's own parameter and buffer names.

(Being written: state_dict, load_state_dict, optimizer_state_dict, load_optimizer_state_dict.)
"""

from __future__ import annotations


def state_dict(engine, **options):
    raise NotImplementedError("engine.state_dict is not implemented yet")


def load_state_dict(engine, state, **options):
    raise NotImplementedError("engine.load_state_dict is not implemented yet")


def optimizer_state_dict(engine, **options):
    raise NotImplementedError("engine.optimizer_state_dict is not implemented yet")


def load_optimizer_state_dict(engine, state, **options):
    raise NotImplementedError("engine.load_optimizer_state_dict is not implemented yet")
