"""Helpers of the split QK / V head dim tests (test_fwd_split_dims, test_bwd_split_dims):
one emulator launch of a split problem against float64, and readable test ids."""

from __future__ import annotations

from flashtune import families
from flashtune.codegen.spec import KernelConfig, Problem, Shape


def run_split(p: Problem, config: KernelConfig, shape: Shape, seed: int, v_output: str,
              grid_x: int | None = None) -> None:
    """One emulator launch of ``p`` (its family's random inputs of ``seed``, outputs
    poisoned with NaN) compared with the family's float64 reference; ``v_output``: the
    output of V's head dim ("o", "dv"); ``grid_x``: launch that many blocks in x."""
    from flashtune.runtime.backends.emulator import EmulatorBackend, LaunchOptions

    family = families.of(p)
    kernel = EmulatorBackend(options=LaunchOptions()).load(families.render(p, config))
    inputs = family.random_inputs(p, shape, "cpu", seed)
    assert inputs.tensors["q"].shape[-1] == p.head_dim
    assert inputs.tensors["v"].shape[-1] == p.v_head_dim
    outputs = family.empty_outputs(p, shape, inputs, poison=True)
    assert outputs[v_output].shape[-1] == p.v_head_dim
    plan = family.launch_plan(p, config, shape, inputs, outputs)
    grid = plan.grid if grid_x is None else (grid_x, *plan.grid[1:])
    kernel.launch(grid, plan.args)
    verdict = family.compare(p, shape, outputs, family.reference(p, inputs))
    assert verdict.ok, f"{p.key()} {config.key()} {shape} seed={seed}: {verdict.message}"


def case_id(value: object) -> str:
    """A test id part: a (Q/K, V) head dim pair as ``d192v128``, a feature set, a shape's,
    config's or type's own key."""
    if isinstance(value, tuple):
        return "d{}v{}".format(*value)
    if isinstance(value, frozenset):
        return "+".join(sorted(value)) or "plain"
    key = getattr(value, "key", None)
    return str(key()) if callable(key) else str(getattr(value, "value", value))
