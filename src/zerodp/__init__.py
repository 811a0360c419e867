"""zerodp: data parallelism with ZeRO and FSDP, and the guide's cost models to plan it.

- ``zerodp.plan``   torch-free cost models: memory, collectives, roofline, batch, timeline.
- ``zerodp.engine`` the training engine on torch.distributed (stages 0-3).
- ``zerodp.spawn``  run a function on N local ranks (tests, benchmarks, examples).
- ``zerodp.check``  is sharding exact for this model and optimizer? ``zerodp.check(...)`` (docs/check.md).
"""

__version__ = "0.1.0"


def __getattr__(name):
    # The engine imports torch; keep ``import zerodp`` (and ``zerodp.plan``) torch-free until used.
    if name == "parallelize":
        from zerodp.engine import parallelize

        return parallelize
    if name == "DiLoCo":  # the outer loop's settings: parallelize(..., outer=zerodp.DiLoCo(every=H))
        from zerodp.engine.config import DiLoCo

        return DiLoCo
    if name == "check":  # a subpackage; importing it sets the attribute, as for any submodule
        import importlib

        return importlib.import_module("zerodp.check")
    raise AttributeError(f"module 'zerodp' has no attribute {name!r}")
