"""fp16 on every CPU in the tests.

DeepSpeed's CPU accelerator reports fp16 only where oneDNN has fp16 kernels
(``torch.ops.mkldnn._is_mkldnn_fp16_supported()``: an Intel Xeon with AVX512-FP16 / AMX-FP16
says yes, an AMD EPYC no), and ``load_config`` and DeepSpeed's engine refuse fp16 elsewhere.
torch's CPU kernels compute in fp16 on every CPU all the same (upcast where no native kernel
exists), so the tests tell DeepSpeed's CPU accelerator that fp16 is supported: the fp16 paths
(loss scaling, overflow skips, fp16 save and resume with the scaler's state) then run in CI
on whatever CPU it has.  Production code keeps DeepSpeed's answer.

:func:`allow_cpu_fp16` is called by ``conftest.py`` (the pytest process) and by
``dist_utils`` in every in-process rank (a forked rank does not inherit a patch made after
the forkserver started).
"""
from __future__ import annotations


def allow_cpu_fp16() -> None:
    """Make DeepSpeed's CPU accelerator report fp16 support (idempotent; GPUs untouched)."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    CPU_Accelerator.is_fp16_supported = _supported


def _supported(self) -> bool:  # noqa: ARG001 - the accelerator's method signature
    return True
