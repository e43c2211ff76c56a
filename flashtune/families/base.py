"""The kernel-family interface: everything flashtune knows about one kind of kernel.

A family (the forward, the backward, decoding, a row-wise LSE, ...) declares in one place:
the problems it serves, its search space and the static rules that remove impossible
configs (each naming its reason), its template and the parameters the template binds, its
launch plan (grid, outputs, argument packing), its float64 reference and tolerances, its
FLOP and byte counts, and its default configs. The runtime, verification, tuner, cost model,
benchmarks and the command line reach kernels only through this interface, so adding a
family touches nothing else (``flashtune.families.register`` is the one hook).

Families sit above codegen (value types, rendering) and below runtime and tuner; they may
use torch, since inputs, outputs and references are tensors.
"""

from __future__ import annotations

import secrets
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from flashtune._lazy import lazy_module
from flashtune.codegen.abi import OPERAND_ALIASES, EntryAbi, PackedArgs
from flashtune.codegen.abi import Element as AbiElement
from flashtune.codegen.arch import ArchSpec, get_arch
from flashtune.codegen.dtypes import DType, Dtypes, Fp8Type, Operand
from flashtune.codegen.features import feature, tile_ranged
from flashtune.codegen.params import ParamSpace, Point, Value
from flashtune.codegen.render import TemplateValue, render_template
from flashtune.codegen.spec import (
    BASE_FIELDS,
    MAX_HEAD_DIM,
    KernelConfig,
    KernelSource,
    Problem,
    Shape,
    ShapeLike,
    knob_name_error,
)
from flashtune.errors import FeatureNotSupported, InvalidConfig, InvalidProblem

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())

#: Tensors of one launch by name (inputs or outputs), and the scalars a launch needs.
Tensors = Mapping[str, "torch.Tensor"]


def torch_dtype(dtype: Operand) -> torch.dtype:
    """The torch element type of ``dtype`` (its row of ``codegen.dtypes.ELEMENTS`` or
    ``FP8_ELEMENTS``)."""
    found: torch.dtype = getattr(torch, dtype.element.torch)
    return found


def element_type(dtype: torch.dtype) -> DType:
    """The DType of a torch element type (InvalidProblem naming the legal ones otherwise)."""
    for candidate in DType:
        if torch_dtype(candidate) == dtype:
            return candidate
    legal = " or ".join(f"torch.{d.element.torch}" for d in DType)
    raise InvalidProblem(f"dtype {dtype} is not an element type of the kernels; expected "
                         f"{legal}")


def operand_type(dtype: torch.dtype) -> Operand:
    """The Operand of a torch element type: a DType, or an FP8 type (an input's only);
    InvalidProblem naming the legal ones otherwise."""
    for candidate in Fp8Type:
        if torch_dtype(candidate) == dtype:
            return candidate
    return element_type(dtype)


def element_params(problem: Problem) -> dict[str, TemplateValue]:
    """The template parameters of a kernel with one element type for Q, K, V and O:
    ``element`` (its C++ type, what ``using Element = ...`` binds) and ``element_ptx`` (its
    mma / wgmma operand type). InvalidProblem for a problem whose operands differ (such a
    kernel binds one type per operand)."""
    dtypes = problem.dtypes
    if not dtypes.uniform:
        raise InvalidProblem(f"problem {problem.key()} has element types {dtypes}; this "
                             "kernel has one element type for Q, K, V and O")
    return {"element": dtypes.q.element.cpp, "element_ptx": dtypes.q.element.ptx}


@dataclass(frozen=True)
class LaunchPlan:
    """One launch: the grid and the packed arguments (threads and shared memory are the
    KernelSource's)."""

    grid: tuple[int, int, int]
    args: PackedArgs


@dataclass(frozen=True)
class Verdict:
    """How one launch's outputs compare with the float64 reference."""

    ok: bool
    max_abs: float           # max |out - ref| over the outputs (inf where NaN was left)
    rel_frobenius: float     # ||out - ref||_F / ||ref||_F of the main output
    message: str             # what was wrong, or "" when ok


@dataclass(frozen=True)
class Tolerance:
    """|out - ref| <= atol + rtol * |ref| per element."""

    atol: float
    rtol: float


@dataclass(frozen=True)
class Inputs:
    """Random inputs of one verification or timing launch: tensors and scalars."""

    tensors: Tensors
    scalars: Mapping[str, float]


def timing_window(shape: ShapeLike) -> tuple[int, int]:
    """The (left, right) window a tuning run times a window problem's ``shape`` with, and
    the cost model predicts it with: a quarter of the keys to the left, none to the right,
    as sliding-window models serve (Mistral's 4,096 keys of 16k-32k contexts). Verification
    draws its windows at random instead."""
    return max(1, shape.seqlen_k // 4), 0


def with_timing_window(inputs: Inputs, shape: ShapeLike) -> Inputs:
    """``inputs`` with their window sizes, if they have any, set to ``timing_window``."""
    if "window_left" not in inputs.scalars:
        return inputs
    left, right = timing_window(shape)
    return Inputs(inputs.tensors, {**inputs.scalars, "window_left": left,
                                   "window_right": right})


def generator(device: torch.device | str, seed: int | None) -> torch.Generator:
    """A torch generator on ``device`` seeded with ``seed`` (a fresh random one if None)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(secrets.randbits(63) if seed is None else seed)
    return gen


def close_enough(name: str, out: torch.Tensor, ref: torch.Tensor, tol: Tolerance,
                 bound: torch.Tensor | None = None) -> tuple[float, float, str]:
    """(max |err|, relative Frobenius error, what was wrong or "") of one output.

    ``bound`` (optional, shaped like ``ref``) adds a per-element allowance to ``tol``: e.g.
    a multiple of the same sums computed over absolute values, the classic bound of the
    rounding error of a dot product. NaN left in ``out`` (an element never written over the
    poison) is an infinite error; an infinite reference element must be matched exactly."""
    out64 = out.to(torch.float64)
    infinite = torch.isinf(ref)
    err = (out64 - ref).abs().nan_to_num(float("inf"))
    err = torch.where(infinite & (out64 == ref), torch.zeros_like(err), err)
    finite_ref = ref.masked_fill(infinite, 0.0)
    max_err = float(err.max()) if err.numel() else 0.0
    rel = float(torch.linalg.vector_norm(err)) / max(
        float(torch.linalg.vector_norm(finite_ref)), 1e-30)
    unwritten = int(torch.isnan(out64).sum())
    allowed = tol.atol + tol.rtol * finite_ref.abs()
    if bound is not None:
        allowed = allowed + bound
    bad = int((err > allowed).sum())
    if unwritten or bad:
        rule = f"{tol.atol} + {tol.rtol}*|ref|" + (" + bound" if bound is not None else "")
        return max_err, rel, (f"{name}: {unwritten} elements left unwritten (NaN), {bad} "
                              f"outside |err| <= {rule} (max |err| {max_err:.3g})")
    return max_err, rel, ""


def random_rows(problem: Problem, shape: ShapeLike, seqlen: int, heads: int,
                gen: torch.Generator, device: torch.device | str,
                head_dim: int | None = None) -> torch.Tensor:
    """Standard normal (batch, seqlen, heads, head_dim) rows in the problem's dtype
    (``head_dim``: the problem's unless given, e.g. V's ``v_head_dim``)."""
    return torch.randn(shape.batch, seqlen, heads,
                       problem.head_dim if head_dim is None else head_dim, generator=gen,
                       device=device).to(torch_dtype(problem.dtype))


def attention_matmul_flops(problem: Problem, shape: ShapeLike, matmuls: int) -> float:
    """``matmuls`` products of (Nq x D) by (D x Nk) size per head: 2 B Nq Nk H D each,
    halved when causal (the field's convention for attention FLOPs)."""
    total = (2.0 * matmuls * shape.batch * shape.seqlen_q * shape.seqlen_k * shape.heads_q
             * problem.head_dim)
    return total / 2 if problem.causal else total


def compare_outputs(problem: Problem, shape: Shape, outputs: Tensors, reference: Tensors,
                    checks: Sequence[tuple[str, str, Tolerance]],
                    also_wrong: Sequence[str] = (),
                    bounds: Tensors | None = None) -> Verdict:
    """The verdict of ``close_enough`` over outputs: ``checks`` are (label, output name,
    tolerance), the first one the main output (its relative error is reported);
    ``also_wrong``: further failures the family found itself; ``bounds``: per-element
    allowances of some outputs (by name), added to their tolerance."""
    max_err, rel = 0.0, 0.0
    wrong = []
    for i, (label, name, tol) in enumerate(checks):
        err, rel_i, message = close_enough(label, outputs[name], reference[name], tol,
                                           (bounds or {}).get(name))
        max_err = max(max_err, err)
        rel = rel_i if i == 0 else rel
        if message:
            wrong.append(message)
    wrong += [m for m in also_wrong if m]
    if wrong:
        return Verdict(False, max_err, rel, f"wrong result on {shape.key()} ({problem.key()}): "
                       + "; ".join(wrong))
    return Verdict(True, max_err, rel, "")


#: SMs assumed for a device whose count is unknown (the emulator's virtual device), where a
#: launch sizes its grid by the SM count.
DEFAULT_SM_COUNT = 4


def sm_count(device: torch.device | str) -> int | None:
    """SMs of a CUDA device (None elsewhere: callers then assume DEFAULT_SM_COUNT)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    return int(torch.cuda.get_device_properties(dev).multi_processor_count)


def resource_reason(smem: int, accumulators: int, arch: ArchSpec,
                    max_accumulators: int) -> str | None:
    """Why a tile cannot run on ``arch``: its shared memory per block, or accumulator
    registers per thread beyond ``max_accumulators`` (past which it cannot avoid spilling);
    None when it may."""
    if smem > arch.max_smem_per_block:
        return (f"shared memory {smem} B exceeds the {arch.name} per-block limit "
                f"{arch.max_smem_per_block} B")
    if accumulators > max_accumulators:
        return (f"accumulators need {accumulators} registers per thread, over the "
                f"{max_accumulators} that leave room below {arch.max_regs_per_thread}")
    return None


class KernelFamily(ABC):
    """One kind of kernel. Subclasses set the class attributes and implement the methods."""

    #: The Problem.op this family serves (lowercase letters and digits), e.g. "fwd".
    op: ClassVar[str]
    #: One line for listings (``flashtune families``).
    title: ClassVar[str]
    #: The template entry point in flashtune/templates, e.g. "flash_fwd.cu.jinja".
    template: ClassVar[str]
    #: The arch-specific target its code needs (e.g. "sm_90a" for wgmma), None for any arch.
    target_arch: ClassVar[str | None] = None
    #: The op whose calls this family serves instead of that op's own family, on devices
    #: that run ``target_arch`` (the dispatcher's choice; same arguments and outputs), or
    #: None. E.g. a Hopper forward serves "fwd" calls on compute capability 9.0 devices.
    serves: ClassVar[str | None] = None
    #: The feature switches of a Problem (``codegen.features``) the family implements;
    #: a problem with any other is refused (FeatureNotSupported).
    features: ClassVar[frozenset[str]] = frozenset()
    #: Whether the family also serves every feature that declares a score modification
    #: (``codegen.score_mods``): its kernels apply the declared hooks and take their params.
    score_mods: ClassVar[bool] = False
    #: Where the family takes score modifications but not a block mask's tile ranges (its
    #: kernels evaluate the mask on every score of the tiles they walk): what serves such a
    #: call instead, named in the refusal. None: the tile ranges are taken.
    tile_ranges_refused: ClassVar[str | None] = None
    #: Whether the family's kernels take a V head dim other than Q/K's
    #: (``Problem.head_dim_v``); a split problem is refused (FeatureNotSupported) otherwise.
    #: Not inherited (``__init_subclass__``): a subclass, whose kernels are its own (the
    #: sm_90a and FP8 forwards derive from the mma.sync one), serves split head dims only
    #: where its own body declares it.
    split_head_dims: ClassVar[bool] = False
    #: The largest Q/K head dim the family's kernels take (``spec.MAX_HEAD_DIM``, or one of
    #: ``spec.WIDE_HEAD_DIMS``); not inherited either.
    max_head_dim: ClassVar[int] = MAX_HEAD_DIM
    #: The head dim the commands take when --head-dim is not given (one the family serves).
    default_head_dim: ClassVar[int] = 128

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "split_head_dims" not in cls.__dict__:
            cls.split_head_dims = False
        if "max_head_dim" not in cls.__dict__:
            cls.max_head_dim = MAX_HEAD_DIM

    #: The element types per operand (``codegen.dtypes.Dtypes``) the family's kernels take,
    #: e.g. ``SAME_16BIT``; a problem with any other combination is refused (InvalidProblem).
    #: Every family declares its own: none is accepted by default.
    dtypes: ClassVar[frozenset[Dtypes]] = frozenset()
    #: The kernel's arguments, declared once (``codegen.abi``): the template's ``signature``
    #: parameter, the packers and the emulator's expected signature come from it. None for
    #: a family whose template spells its parameter list itself.
    abi: ClassVar[EntryAbi | None] = None
    #: The template's type name of each operand's elements in the rendered ``signature``
    #: (all ``Element`` by default; the FP8 forward's inputs are ``Fp8``).
    abi_aliases: ClassVar[Mapping[AbiElement, str]] = OPERAND_ALIASES

    # ---------------------------------------------------------------- problems

    def check_problem(self, problem: Problem) -> None:
        """InvalidProblem unless this family serves ``problem`` (its op, features and element
        types); FeatureNotSupported for a feature switch not in ``features`` (nor a
        declared score modification, where the family takes them)."""
        if problem.op != self.op:
            raise InvalidProblem(f"problem {problem.key()} is for family {problem.op!r}, "
                                 f"not {self.op!r}")
        missing = [name for name in problem.features if name not in self.features
                   and not (self.score_mods and feature(name).score is not None)]
        if missing:
            raise FeatureNotSupported(
                f"the {self.op!r} kernel family ({self.title}) does not implement "
                f"{', '.join(feature(name).title for name in missing)}; see the feature "
                "table in the README for the families that do")
        if problem.head_dim > self.max_head_dim:
            raise FeatureNotSupported(
                f"the {self.op!r} kernel family ({self.title}) takes Q/K head dims up to "
                f"{self.max_head_dim}, got {problem.head_dim} (problem {problem.key()}); the "
                "mma.sync forward ('fwd') and the sm_90a forward ('fwd90aws') serve 512 and "
                "576 beside V's head dim of at most 256, the mma.sync backward ('bwd', "
                "'bwddet') and decoding ('decode') beside V's up to Q/K's")
        if problem.split_head_dims and not self.split_head_dims:
            raise FeatureNotSupported(
                f"the {self.op!r} kernel family ({self.title}) needs V's head dim equal to "
                f"Q/K's, got head_dim={problem.head_dim} and head_dim_v={problem.head_dim_v} "
                f"(problem {problem.key()}); the mma.sync forward ('fwd') serves split head "
                "dims, or pad v's head dim to q's")
        tiled = tile_ranged(problem.features) if self.tile_ranges_refused else []
        if tiled:
            raise FeatureNotSupported(
                f"the {self.op!r} kernel family ({self.title}) does not walk a block mask's "
                f"tile ranges ({', '.join(tiled)}); {self.tile_ranges_refused}")
        if problem.dtypes not in self.dtypes:
            accepted = (", ".join(sorted(map(str, self.dtypes))) if self.dtypes
                        else "none (the family declares no `dtypes`)")
            raise InvalidProblem(
                f"the {self.op!r} kernel family ({self.title}) does not take the element "
                f"types {problem.dtypes} (problem {problem.key()}); it takes: {accepted} (one "
                "word: that type for Q, K/V and O)")

    # ---------------------------------------------------------------- search space

    @abstractmethod
    def space(self, problem: Problem) -> ParamSpace:
        """The declared tunables of ``problem`` and their values in search order."""

    def config(self, point: Point) -> KernelConfig:
        """The config a point of ``space`` names (InvalidConfig if none can exist)."""
        return KernelConfig.from_dict(point)

    def point(self, config: KernelConfig) -> dict[str, Value]:
        """The point of ``space`` that names ``config`` (inverse of ``config``)."""
        return dict(config.to_dict())

    def static_check(self, problem: Problem, config: KernelConfig, arch: ArchSpec
                     ) -> str | None:
        """Why ``config`` can never run ``problem`` on ``arch``, or None when it may: a
        knob the family's space does not declare, else the family's own ``rules``."""
        if self.target_arch is not None and not get_arch(self.target_arch).runs_on(arch):
            target = get_arch(self.target_arch)
            return (f"the {self.op!r} family is built for {target.name}, which runs only on "
                    f"compute capability {target.major}.{target.minor} devices, not on "
                    f"{arch.name}")
        declared = self.space(problem).names
        unknown = [name for name, _ in config.extras if name not in declared]
        if unknown:
            return (f"knob(s) {unknown} are not knobs of the {self.op!r} family; its knobs "
                    f"are {list(declared)}")
        return self.rules(problem, config, arch)

    @abstractmethod
    def rules(self, problem: Problem, config: KernelConfig, arch: ArchSpec) -> str | None:
        """The family's static rules: why ``config`` cannot run, each naming its reason."""

    def search_space(self, problem: Problem) -> list[KernelConfig]:
        """Every structurally legal config of ``space(problem)``, in a stable order;
        InvalidConfig when the space declares a knob no config can carry (a misnamed knob
        would otherwise leave the space silently empty)."""
        space = self.space(problem)
        bad = [why for name in space.names if name not in BASE_FIELDS
               for why in (knob_name_error(name),) if why is not None]
        if bad:
            raise InvalidConfig(f"the {self.op!r} family's space: {'; '.join(bad)}")
        out: list[KernelConfig] = []
        for point in space.points():
            try:
                out.append(self.config(point))
            except InvalidConfig:
                continue
        return out

    def candidates(self, problem: Problem, arch: ArchSpec) -> list[KernelConfig]:
        """The search space minus every config that ``static_check`` rules out on ``arch``."""
        return [c for c in self.search_space(problem)
                if self.static_check(problem, c, arch) is None]

    @abstractmethod
    def default_config(self, problem: Problem, arch: ArchSpec) -> KernelConfig:
        """What runs ``problem`` on ``arch`` when nothing is tuned; passes static_check."""

    def fitting(self, problem: Problem, config: KernelConfig, arch: ArchSpec) -> KernelConfig:
        """``config``, the family's default, when it passes static_check on ``arch``;
        InvalidConfig naming why otherwise."""
        why = self.static_check(problem, config, arch)
        if why is not None:
            raise InvalidConfig(f"the default {config.key()} does not fit {problem.key()} on "
                                f"{arch.name}: {why}")
        return config

    def default_reason(self, problem: Problem, arch: ArchSpec) -> str:
        """Why ``default_config`` was chosen (one line, for ``explain`` and docs)."""
        return "the family's default"

    # ---------------------------------------------------------------- code

    @abstractmethod
    def template_params(self, problem: Problem, config: KernelConfig
                        ) -> dict[str, TemplateValue]:
        """The values the template binds (ints, bools and fixed words only)."""

    @abstractmethod
    def smem_bytes(self, problem: Problem, config: KernelConfig) -> int:
        """Dynamic shared memory of one block."""

    def threads(self, problem: Problem, config: KernelConfig) -> int:
        """Threads of one block of ``config``'s kernel (default: its warps' threads). A
        family whose block has threads beyond the config's warps (a producer warpgroup)
        says so here; the KernelSource carries the count, and every launch, the emulator,
        the resource check and the cost model read it from there or from this hook."""
        return config.threads

    def compute_warps(self, problem: Problem, config: KernelConfig) -> int:
        """Warps of one block that issue the tensor-core math (default: the config's warps;
        a producer warpgroup does not). ``profile`` multiplies a warp's main-loop FLOPs by
        it."""
        return config.num_warps

    def render_params(self, problem: Problem, config: KernelConfig
                      ) -> dict[str, TemplateValue]:
        """``template_params`` and, with an ``abi``, the rendered parameter list of the
        problem's feature switches as ``signature``."""
        params = self.template_params(problem, config)
        if self.abi is not None:
            params["signature"] = self.abi.signature(problem.features, self.abi_aliases)
        return params

    def render(self, problem: Problem, config: KernelConfig) -> KernelSource:
        """The KernelSource of ``problem`` x ``config``."""
        self.check_problem(problem)
        return render_template(self.template, problem, config,
                               self.render_params(problem, config),
                               smem_bytes=self.smem_bytes(problem, config),
                               threads=self.threads(problem, config),
                               target=self.target_arch)

    # ---------------------------------------------------------------- launch plan

    @abstractmethod
    def random_inputs(self, problem: Problem, shape: Shape, device: torch.device | str,
                      seed: int | None = None) -> Inputs:
        """Fresh random inputs of ``shape`` (never zeros), from ``seed`` or a fresh one."""

    def bind(self, problem: Problem, config: KernelConfig, inputs: Inputs) -> Inputs:
        """``inputs`` as a launch of ``config`` uses them (default: unchanged). A family
        whose config names a run-time value the outputs and the reference depend on (the
        decode family's split count) sets it here, before outputs are made."""
        return inputs

    def tuning_shapes(self, problem: Problem, seqlen: int,
                      batch_heads: Sequence[tuple[int, int]], shape_class: str = ""
                      ) -> tuple[list[Shape], Shape] | None:
        """The shapes a tuning bucket of ``seqlen`` (and ``shape_class``) is timed on and
        the shape it is verified on, or None for the forward's (square shapes of the
        standard sweep). ``batch_heads``: the (batch, heads) pairs asked for, () for the
        family's own."""
        return None

    def timing_inputs(self, problem: Problem, shape: Shape, device: torch.device | str,
                      shape_class: str = "") -> Inputs:
        """The inputs a tuning run times ``shape`` of a bucket of ``shape_class`` on
        (default: ``random_inputs`` with a window problem's window set to ``timing_window``;
        decoding lays out the cache as the class says)."""
        return with_timing_window(self.random_inputs(problem, shape, device), shape)

    #: The shape classes ``flashtune tune`` tunes when none are named (none: one bucket
    #: for every call shape).
    default_shape_classes: ClassVar[tuple[str, ...]] = ()

    def check_shape_class(self, problem: Problem, shape_class: str) -> None:
        """Raise InvalidProblem unless ``shape_class`` is one of this family's classes of
        call shapes tuned apart (``ProblemBucket.shape_class``); a family has none but ''
        unless it says otherwise (decoding)."""
        if shape_class:
            raise InvalidProblem(f"the {self.op!r} family tunes no shape classes, got "
                                 f"{shape_class!r}; leave the shape class out")

    @abstractmethod
    def empty_outputs(self, problem: Problem, shape: Shape, inputs: Inputs, *,
                      poison: bool) -> dict[str, torch.Tensor]:
        """The outputs a launch writes; filled with NaN when ``poison`` (so an element the
        kernel never writes is caught), uninitialised otherwise."""

    def hot_packer(self, problem: Problem, config: KernelConfig) -> Any:
        """The packer the runtime calls on every call of the op this family serves, made
        once per plan (None: the op's composition packs with the family's ABI itself). Its
        calling convention is the op's: the forward's is ``families.fwd.args.FwdPacker``,
        so a family that ``serves`` "fwd" supplies one of those."""
        return None

    @abstractmethod
    def launch_plan(self, problem: Problem, config: KernelConfig, shape: Shape,
                    inputs: Inputs, outputs: Tensors) -> LaunchPlan:
        """Grid and packed arguments of one launch over these tensors."""

    # ---------------------------------------------------------------- verification

    @abstractmethod
    def reference(self, problem: Problem, inputs: Inputs) -> dict[str, torch.Tensor]:
        """The outputs computed independently in float64 from the same (rounded) inputs."""

    @abstractmethod
    def compare(self, problem: Problem, shape: Shape, outputs: Tensors,
                reference: Tensors) -> Verdict:
        """Whether the outputs match the reference within the family's tolerances."""

    # ---------------------------------------------------------------- counts

    @abstractmethod
    def flops(self, problem: Problem, shape: ShapeLike) -> float:
        """FLOPs of one call by the field's convention for this kind of kernel."""

    @abstractmethod
    def min_bytes(self, problem: Problem, shape: ShapeLike) -> float:
        """Global-memory bytes one call must move at least (each input read once, each
        output written once)."""
