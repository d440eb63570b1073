"""The schedule registry: schedule name -> its :class:`ScheduleSpec` (a table; imports no schedule).

``"ds_mp": {"pipeline": {"schedule": NAME}}`` picks a schedule by name.  Everything ds_mp knows of
a schedule is its spec: the timetable class, the checks of its config (the ``"ds_mp"`` block and
the DeepSpeed JSON), its pipeline layout, parameter-group and batching hooks, and ``runtime(engine)``,
the object whose methods handle its instructions and which owns its state.  Config validation,
batching and the engine build ask the spec, never a schedule's name.

A built-in's entry is ``"module:attribute"`` of its spec, which lives in the schedule's own files
and is imported on first use (:func:`schedule_spec`); ``register_schedule(name, cls, runtime=)``
builds a plain spec for a user's ``PipeSchedule`` class, and ``register_schedule(name, spec)``
registers a spec with every hook a built-in has.

This module is on the ground floor, in ``ds_mp.config`` (which validates the name against it):
it is a table of names and imports no schedule.  ``ds_mp.schedules.registry`` re-exports it.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterator, Optional, Protocol, Union

from ds_mp.config.schema import MODEL_TYPES, ConfigError, DsMpConfig, InlineModel

if TYPE_CHECKING:
    from ds_mp.engine_view import RuntimeEngine, StageView

SCHEDULES: dict[str, Union[str, "ScheduleSpec", type]] = {
    "1f1b": "ds_mp.schedules.gpipe:ONE_F_ONE_B",
    "gpipe": "ds_mp.schedules.gpipe:GPIPE",
    "terapipe": "ds_mp.schedules.terapipe.spec:TERAPIPE",
    "zb-h1": "ds_mp.schedules.zero_bubble:ZB_H1",
    "ouroboros": "ds_mp.schedules.ouroboros.spec:OUROBOROS",
    "interleaved": "ds_mp.schedules.interleaved:INTERLEAVED",
    "zb-v": "ds_mp.schedules.zb_v:ZB_V",
}

ALL_FAMILIES = tuple(MODEL_TYPES)  # every model family ds_mp trains (a spec tested with all of them)


class TimetableHooks(Protocol):
    """What the engine asks of a schedule class (a ``PipeSchedule`` subclass), each optional:
    absent, the default in brackets applies."""

    dynamic_shape: ClassVar[bool]  # activation shapes change between sends: announce each one [False]
    posted_sends: bool  # set by the engine on a timetable schedule: compile sends for posting [absent: not compiled]

    @classmethod
    def from_engine(cls, engine: StageView) -> "TimetableHooks":
        """Build the step's schedule from the engine [``cls(micro_batches=, stages=, stage_id=)``]."""

    @staticmethod
    def pipeline_layout(cfg: Any, hf_config: Any) -> tuple[list[str], list[int]]:
        """The pipeline's layer order and stage bounds (Ouroboros' ring) [the family's, partitioned]."""

    def acknowledged(self) -> list[int]:
        """Per receive, how many of this stage's sends to the sender it acknowledges [all so far]."""


class ScheduleRuntime(Protocol):
    """A schedule's runtime: made once per engine by its spec's ``runtime``, it owns the
    schedule's state; its methods named in ``instructions`` handle the schedule's own instruction
    types (called with the instruction's kwargs).  Every hook below is optional: absent, the engine
    does what the bracket says."""

    instructions: ClassVar[dict[type, str]]  # instruction type -> name of the method handling it [none]
    takes_layouts: ClassVar[bool]  # it attends with packed/padded layouts [True]

    def state_dict(self) -> dict:
        """Work in flight across steps, saved per rank in checkpoints [no state: not saved]."""

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s work in flight."""

    def tp_free(self) -> bool:
        """The state is the same on every TP rank (resumes at another TP degree) [False]."""

    def aggregate_loss(self) -> Any:
        """``train_batch``'s loss on every stage [DeepSpeed's: the loss stage's mean, broadcast]."""

    def eval_batch(self, data_iter: Iterator, *args: Any, num_micro_batches: int | None = None, **kwargs: Any) -> Any:
        """The whole of ``eval_batch`` [DeepSpeed's inference schedule]."""

    def layout_of(self, buffer_id: int) -> Any:
        """The layout the model attends with for ``buffer_id`` (NotImplemented: the engine's) [the engine's]."""

    def data_stages(self) -> set[int]:
        """The pipeline stages that read micro-batches [first and last]."""

    def stage_ends(self) -> tuple[bool, bool] | None:
        """(first, last): whether the (virtual) stage running now is the pipe's first/last [DeepSpeed's]."""


RuntimeFactory = Callable[[Any], ScheduleRuntime]


def load(entry: Union[str, Any]) -> Any:
    """``"module:attribute"`` imported (an attribute path may be dotted), anything else as it is."""
    if not isinstance(entry, str):
        return entry
    module, attr = entry.split(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class ScheduleSpec:
    """One schedule, whole.  A built-in subclasses it beside its timetable and overrides the hooks
    it needs; every hook has the default a plain ``PipeSchedule`` (DeepSpeed's 1F1B) needs.

    Fields: ``timetable`` (a ``PipeSchedule`` subclass, :class:`TimetableHooks`, or its
    ``"module:Class"``); ``runtime`` (``engine -> ScheduleRuntime`` or its ``"module:function"``;
    None: no instructions or state of its own); ``families`` (the model families it is tested
    with, ``model_type`` names); ``batch_ramp`` (True: tested with a changing batch; False:
    untested, refused with the tested ones named; a string: refused with that line);
    ``noise_scale`` (its gradients go through DeepSpeed's DP reduction, so B_simple is measurable);
    ``lora`` (True, or the line refusing LoRA); ``virtual_stages`` (it takes
    ``pipeline.virtual_stages`` > 1); ``param_groups`` (``(net, cfg, pp_rank) -> keys`` or its
    ``"module:function"``: one optimizer group per key; None: the default groups); ``token_slices``
    (its last stage computes the loss of token slices of a micro-batch, not of whole sequences: a
    loss that needs whole sequences, ``LossSpec.token_sliceable = False``, is refused);
    ``delayed_gradients`` (its updates apply gradients computed on older weights: a loss that must
    match a one-process step, DPO, refuses it); ``context_parallel``
    (True: tested with ``context_parallel.size`` > 1, its p2p buffers carrying seq_len/C rows; False:
    untested, refused with the tested ones named; a string: refused with that line); ``carry`` (True:
    its stages pass a micro-batch's carry, ``ds_mp.models.carry``, with the hidden state, so a MoE's
    aux loss is pooled over all its layers; a string: the line refusing ``output_router_logits``)."""

    timetable: Union[str, type]
    runtime: Union[str, RuntimeFactory, None] = None
    families: tuple[str, ...] = ("gpt2",)
    batch_ramp: Union[bool, str] = False
    noise_scale: bool = True
    lora: Union[bool, str] = True
    virtual_stages: bool = False
    param_groups: Union[str, Callable[..., Any], None] = None
    token_slices: bool = False
    delayed_gradients: bool = False
    context_parallel: Union[bool, str] = False
    carry: Union[bool, str] = True

    # --- config: checked on every rank before any collective ---------------------------------
    def check_layout(self, cfg: DsMpConfig, shape: InlineModel) -> None:
        """The pipeline's stages against the model (before ``pipeline.partition`` is checked)
        [at most one stage per block]."""
        if cfg.pipeline.stages > shape.n_layer:
            raise ConfigError(f"ds_mp.pipeline.stages: {cfg.pipeline.stages} stages but the model has "
                              f"{shape.n_layer} blocks; use at most {shape.n_layer} stages")

    def check(self, cfg: DsMpConfig, shape: InlineModel) -> None:
        """Its own checks of the ``"ds_mp"`` block (after the pipeline partition's) [none]."""

    def check_deepspeed(self, raw: dict, cfg: DsMpConfig) -> None:
        """Its checks of the DeepSpeed JSON beside the block (precision, ZeRO, accumulation) [none]."""

    # --- batching and build ------------------------------------------------------------------
    def micro_multiple(self, cfg: DsMpConfig) -> int:
        """Micro-batches per step (per DP rank) must be a multiple of this: a batch ramp's sizes
        are [1]."""
        return 1

    def micro_multiple_reason(self, cfg: DsMpConfig) -> str:
        """The factor :meth:`micro_multiple` adds to a refused batch size's unit, with its reason."""
        n = self.micro_multiple(cfg)
        return f"{n} (the {cfg.pipeline.schedule} schedule runs a multiple of {n} micro-batches per step)"

    def group_keys(self, net: Any, cfg: DsMpConfig, pp_rank: int) -> Optional[list]:
        """One optimizer parameter group per key of this rank's parameters [None: the default groups]."""
        return load(self.param_groups)(net, cfg, pp_rank) if self.param_groups else None

    def timetable_class(self) -> type:
        """The timetable (``PipeSchedule`` subclass), imported on first use."""
        return load(self.timetable)

    def pipeline_layout(self, cfg: DsMpConfig, hf_config: Any,
                        costs: Any = None) -> Optional[tuple[list[str], list[int]]]:
        """The pipeline's layer order and stage bounds [None: the family's, partitioned];
        ``costs``, the measured layer costs under ``"partition": "cost"``, is passed on only then."""
        cls = self.timetable_class()
        if not hasattr(cls, "pipeline_layout"):
            return None
        return cls.pipeline_layout(cfg, hf_config) if costs is None else cls.pipeline_layout(cfg, hf_config, costs)

    def dynamic_shape(self) -> bool:
        """Activation shapes change between sends (announce each one) [False]."""
        return getattr(self.timetable_class(), "dynamic_shape", False)

    def make_runtime(self, engine: RuntimeEngine) -> Optional[ScheduleRuntime]:
        """Its runtime for ``engine`` (made once per engine) [None]."""
        return load(self.runtime)(engine) if self.runtime else None


def schedule_spec(name: str) -> ScheduleSpec:
    """The spec registered as ``name`` (its module imported on first use); a bare ``PipeSchedule``
    class in the table gets the plain spec."""
    entry = load(SCHEDULES[name])
    return entry if isinstance(entry, ScheduleSpec) else ScheduleSpec(timetable=entry)


def names_where(test: Callable[[ScheduleSpec], bool]) -> list[str]:
    """The registered names whose spec passes ``test``, in table order (for messages listing them)."""
    return [n for n in SCHEDULES if test(schedule_spec(n))]


def register_schedule(name: str, cls: Union[type, ScheduleSpec], runtime: RuntimeFactory | None = None) -> Any:
    """Register a schedule as ``name``: a :class:`ScheduleSpec` (every hook a built-in has), or a
    ``PipeSchedule`` subclass ``cls`` (:class:`TimetableHooks`) with ``runtime(engine)`` making its
    :class:`ScheduleRuntime` (handlers of its own instructions, its state, its hooks), which is
    ``ScheduleSpec(timetable=cls, runtime=runtime)``; returns ``cls``."""
    from deepspeed.runtime.pipe.schedule import PipeSchedule

    if isinstance(cls, ScheduleSpec):
        if runtime is not None:
            raise TypeError(f"schedule {name!r}: give the runtime in the spec, not beside it")
        spec = cls
    elif isinstance(cls, type) and issubclass(cls, PipeSchedule):
        spec = ScheduleSpec(timetable=cls, runtime=runtime)
    else:
        raise TypeError(f"schedule {name!r} must be a PipeSchedule subclass or a ScheduleSpec, got {cls!r}")
    if not isinstance(spec.timetable, str) and not (isinstance(spec.timetable, type)
                                                    and issubclass(spec.timetable, PipeSchedule)):
        raise TypeError(f"schedule {name!r}: the timetable must be a PipeSchedule subclass, got {spec.timetable!r}")
    if spec.runtime is not None and not isinstance(spec.runtime, str) and not callable(spec.runtime):
        raise TypeError(f"schedule {name!r}: runtime must be a callable engine -> runtime, got {spec.runtime!r}")
    SCHEDULES[name] = spec
    return cls


def resolve(name: str) -> type:
    """The timetable class of the schedule registered as ``name`` (importing it on first use)."""
    return schedule_spec(name).timetable_class()


__all__ = ["SCHEDULES", "ALL_FAMILIES", "ScheduleSpec", "ScheduleRuntime", "TimetableHooks", "RuntimeFactory",
           "load", "names_where", "register_schedule", "resolve", "schedule_spec"]
