"""Pure-Python unroll of every registered schedule: no engine, no processes.

A small simulator plays all stages' instruction streams step by step, tracking which
micro-batch each pipe buffer holds:

* ``LoadMicroBatch`` (first/last stage) loads the next micro-batch of the data iterator;
* ``RecvActivation``/``RecvGrad`` take the micro index of the matching ``Send*`` issued by
  the neighbour at the same step (blocking p2p is resolved as a rendezvous in program
  order, so a mis-ordered pair is reported as a deadlock);
* on the last stage, the labels (``LoadMicroBatch``) and the activations
  (``RecvActivation``) of a buffer must belong to the same micro-batch at ``ForwardPass``.

Checked: every micro-batch is forwarded and backwarded exactly once per stage, forward
before backward, a buffer is never overwritten while its micro-batch is in flight, buffer
ids are ``< num_pipe_buffers()``, and the last step holds ``ReduceGrads`` + ``OptimizerStep``.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest
from deepspeed.runtime.pipe import schedule as ds

from ds_mp.schedules.registry import SCHEDULES, resolve
from ds_mp.schedules.gpipe import GPipe, OneFOneB
from p2p_play import rendezvous


def _plain(name: str) -> bool:
    """Schedules built as ``cls(micro_batches=, stages=, stage_id=)`` on a linear pipe."""
    return not hasattr(resolve(name), "from_engine")


UNROLLABLE = sorted(n for n in SCHEDULES if _plain(n))


@dataclass
class Stage:
    """Simulated state of one stage: micro index per buffer role."""

    s: int
    K: int
    labels: dict = field(default_factory=dict)  # buffer -> micro of loaded batch/labels
    acts: dict = field(default_factory=dict)  # buffer -> micro of input activations
    grads: dict = field(default_factory=dict)  # buffer -> micro of received output grads
    inflight: dict = field(default_factory=dict)  # buffer -> micro forwarded, not yet backwarded
    done_bwd: dict = field(default_factory=dict)  # buffer -> micro last backwarded
    fwd_out: dict = field(default_factory=dict)  # buffer -> micro of last forward output
    forwards: list = field(default_factory=list)
    backwards: list = field(default_factory=list)
    loaded: int = 0

    def write_input(self, buf: int, micro: int, role: dict) -> None:
        held = self.inflight.get(buf)
        assert held is None or held == micro, \
            f"stage {self.s}: buffer {buf} overwritten with micro {micro} while micro {held} is in flight"
        role[buf] = micro

    def local(self, cmd: ds.PipeInstruction) -> None:
        b = cmd.kwargs.get("buffer_id")
        if isinstance(cmd, ds.LoadMicroBatch):
            assert self.s in (0, self.K - 1), f"stage {self.s} loads data but is neither first nor last"
            self.write_input(b, self.loaded, self.labels)
            if self.s == 0:
                self.acts[b] = self.loaded
            self.loaded += 1
        elif isinstance(cmd, ds.ForwardPass):
            m = self.acts.get(b)
            assert m is not None, f"stage {self.s}: forward on empty buffer {b}"
            if self.s == self.K - 1:
                assert self.labels.get(b) == m, \
                    f"stage {self.s}: buffer {b} has activations of micro {m} but labels of {self.labels.get(b)}"
            assert self.inflight.get(b) is None, f"stage {self.s}: buffer {b} forwarded twice"
            self.inflight[b] = self.fwd_out[b] = m
            self.forwards.append(m)
        elif isinstance(cmd, ds.BackwardPass):
            m = self.inflight.pop(b, None)
            assert m is not None, f"stage {self.s}: backward on buffer {b} before its forward"
            if self.s < self.K - 1:
                assert self.grads.get(b) == m, \
                    f"stage {self.s}: buffer {b} backwards micro {m} with the grad of {self.grads.get(b)}"
            self.done_bwd[b] = m
            self.backwards.append(m)

    def sent_micro(self, cmd: ds.PipeInstruction) -> int:
        b = cmd.buffer_id
        if isinstance(cmd, ds.SendActivation):
            assert b in self.fwd_out, f"stage {self.s}: sends activation of unforwarded buffer {b}"
            return self.fwd_out[b]
        assert b in self.done_bwd, f"stage {self.s}: sends grad of buffer {b} before its backward"
        return self.done_bwd[b]


def unroll(cls: type, M: int, K: int) -> tuple[list[Stage], list[list[list]]]:
    """Play all ``K`` stages of ``cls`` with ``M`` micro-batches; return states and steps."""
    scheds = [cls(micro_batches=M, stages=K, stage_id=s) for s in range(K)]
    streams = [list(sch.steps()) for sch in scheds]
    for s, (sch, steps) in enumerate(zip(scheds, streams)):
        for cmd in itertools.chain.from_iterable(steps):
            if isinstance(cmd, ds.BufferOpInstruction):
                assert 0 <= cmd.buffer_id < sch.num_pipe_buffers(), \
                    f"stage {s}: {cmd} outside num_pipe_buffers()={sch.num_pipe_buffers()}"
    stages = [Stage(s, K) for s in range(K)]

    def transfer(s: int, peer: int, send: ds.PipeInstruction, recv: ds.PipeInstruction) -> None:
        role = stages[peer].acts if isinstance(recv, ds.RecvActivation) else stages[peer].grads
        stages[peer].write_input(recv.buffer_id, stages[s].sent_micro(send), role)

    rendezvous(streams, lambda s, cmd: stages[s].local(cmd), transfer, same_length=False)
    return stages, streams


@pytest.mark.parametrize("name", UNROLLABLE)
@pytest.mark.parametrize("K", [1, 2, 3, 4])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5])
def test_schedule_unrolls(name: str, K: int, M: int) -> None:
    stages, streams = unroll(resolve(name), M, K)
    for st in stages:
        assert sorted(st.forwards) == list(range(M)), f"stage {st.s}: forwards {st.forwards}"
        assert sorted(st.backwards) == list(range(M)), f"stage {st.s}: backwards {st.backwards}"
        assert not st.inflight, f"stage {st.s}: never backwarded {st.inflight}"
        assert st.loaded == (M if st.s in (0, K - 1) else 0)
    for s, steps in enumerate(streams):
        last = [type(c) for c in steps[-1]]
        assert ds.ReduceGrads in last and ds.OptimizerStep in last, f"stage {s}: last step {steps[-1]}"
        assert last.index(ds.ReduceGrads) < last.index(ds.OptimizerStep)
        body = [type(c) for step in steps[:-1] for c in step]
        assert ds.OptimizerStep not in body, f"stage {s}: optimizer step before the last step"


def test_builtin_schedules_registered_and_unrolled() -> None:
    assert resolve("1f1b") is OneFOneB and resolve("gpipe") is GPipe
    assert {"1f1b", "gpipe"} <= set(UNROLLABLE)


def test_gpipe_timetable_matches_docstring() -> None:
    """K=3, M=3: stage s forwards m at step s+m, backwards at P+(K-1-s)+m with P=5."""
    for s in range(3):
        steps = list(GPipe(micro_batches=3, stages=3, stage_id=s).steps())
        fwd = {c.buffer_id: t for t, step in enumerate(steps) for c in step if isinstance(c, ds.ForwardPass)}
        bwd = {c.buffer_id: t for t, step in enumerate(steps) for c in step if isinstance(c, ds.BackwardPass)}
        assert fwd == {m: s + m for m in range(3)}
        assert bwd == {m: 5 + (2 - s) + m for m in range(3)}


class _SwapsLabels(GPipe):
    """Broken on purpose: the last stage loads labels into the wrong buffers."""

    def _forward_step(self, t: int) -> list:
        cmds = super()._forward_step(t)
        if self.stage_id == self.stages - 1 and self.stages > 1:
            cmds = [ds.LoadMicroBatch(buffer_id=self.micro_batches - 1 - c.buffer_id)
                    if isinstance(c, ds.LoadMicroBatch) else c for c in cmds]
        return cmds


class _RecvsEarly(GPipe):
    """Broken on purpose: stage 1 receives each activation one step before it is sent."""

    def _forward_step(self, t: int) -> list:
        cmds = [c for c in super()._forward_step(t) if not isinstance(c, ds.RecvActivation)]
        if self.stage_id == 1 and 0 <= t + 1 - self.stage_id < self.micro_batches:
            cmds.insert(0, ds.RecvActivation(buffer_id=t + 1 - self.stage_id))
        return cmds


@pytest.mark.parametrize("broken, message", [(_SwapsLabels, "labels of"), (_RecvsEarly, "deadlock")])
def test_simulator_catches_broken_schedules(broken: type, message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        unroll(broken, 3, 2)
