"""``python -m trainkit plan script.py:make_trainer --target "tpu v5e:16x16" --batch 1024``: the
plan of a trainer's real train step for devices that are not here, printed as a table, so a
configuration is checked before the cluster is rented (docs/targets.md).

``make_trainer()`` (any name; ``script.py`` is imported, its ``__main__`` block not run) returns
``(trainer, sample)``: a :class:`trainkit.Trainer` and a sample batch in any form ``fit`` takes
(a few rows suffice: ``--batch`` sets the global batch planned). ``JAX_PLATFORMS=cpu`` is set
for you (before JAX starts), as the CUDA plugin needs it.

(A command of the package rather than a ``trainkit.plan`` module: ``tk.plan`` is
:mod:`trainkit.planning.plan`, which a module of that name would shadow.)
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainkit", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["plan"], help="what to do (plan: the table for a target)")
    parser.add_argument("function", help="script.py:function returning (trainer, sample batch)")
    parser.add_argument("--target", required=True, help='e.g. "tpu v5e:4x4", "tpu v5p:2x2x2", "h100 x8", "h100 2x8"')
    parser.add_argument("--batch", type=int, default=None, help="global batch size (default: the sample's rows)")
    parser.add_argument("--candidates", default=None, help="comma-separated: dp, fsdp, hybrid (default: all)")
    return parser.parse_args(argv)


def load_function(spec: str):
    """``path/to/script.py:name`` imported as a module (its ``__main__`` block does not run)."""
    path, _, name = spec.rpartition(":")
    if not path or not name or not os.path.isfile(path):
        raise SystemExit(f"expected script.py:function with an existing script; received {spec!r}")
    module_spec = importlib.util.spec_from_file_location("trainkit_plan_script", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    module_spec.loader.exec_module(module)
    function = module.__dict__.get(name)
    if function is None:
        raise SystemExit(f"{path} defines no {name!r}")
    if not callable(function):
        raise SystemExit(
            f"{path}:{name} is a {type(function).__name__}, not a function: name a function that returns (trainer, "
            "sample batch), e.g. def make_trainer(): ..."
        )
    return function


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from trainkit.planning import targets

    try:  # a misspelled target is refused before the script runs or JAX starts (its plugins log to stderr)
        targets.parse(args.target)
    except ValueError as error:
        return _refused(error)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX starts: the CUDA plugin's compiler needs it
    import jax  # imported already (by trainkit), but its backends not started: the setting still applies

    jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])
    made = load_function(args.function)()
    if not (isinstance(made, tuple) and len(made) == 2):
        raise SystemExit(f"{args.function} must return (trainer, sample batch); received {type(made).__name__}")
    trainer, sample = made
    candidates = None if args.candidates is None else [c.strip() for c in args.candidates.split(",")]
    try:
        plan = trainer.plan(sample, target=args.target, batch_size=args.batch, candidates=candidates, verbose=1)
    except (ValueError, TypeError, ImportError) as error:  # trainkit's own refusals say what to do: no traceback
        return _refused(error)
    return 0 if plan.recommended is not None else 1


def _refused(error: Exception) -> int:
    print(f"python -m trainkit plan: {type(error).__name__}: {error}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
