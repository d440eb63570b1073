"""A job's start-up, agreed by every rank: one node's failed check ends every node within seconds.

The checks that need no communication (config, data, model files, lock, resume point) run on
every rank first (:func:`checked_then_agreed`), but a rank whose check fails does not exit
alone: its peers would wait for it in the rendezvous until its timeout (300 s) and then die
naming no cause.  Every rank joins the rendezvous anyway and the outcomes are exchanged (one
``all_gather_object``); then every rank of every node ends with the one line naming the rank, host
and cause, or the job goes on.  The same exchange compares what each host sees of the output
directory: checkpoints one node sees and another does not mean ``output_dir`` is node-local, and
that (not "run without --resume") is the cause to name.  After global rank 0 took the lock,
:func:`check_shared_output_dir` has every rank read the lock it wrote (the probe): a rank that
does not see it is on another filesystem, and the run is refused before it trains.
"""
from __future__ import annotations

import errno
import os
import socket
import time
from typing import Any, Callable

from ds_mp.training.run_dir import LOCK, finished_tags

SHARED_FS = "docs/getting-started.md#multi-node"
PROBE_TRIES = 3  # reads of the lock, 1 s apart, before a rank is said not to share output_dir
FAILED_RENDEZVOUS_S = 60.0  # how long a rank whose check failed waits for its peers to hear why


class StartupError(RuntimeError):
    """A start-up check failed on some rank (or the ranks disagree); one line naming it."""


def rendezvous(init: Callable[[], None]) -> None:
    """``init`` (the process-group rendezvous), with a taken port said in one line."""
    try:
        init()
    except Exception as e:  # noqa: BLE001 - torch raises DistNetworkError / RuntimeError variants
        text = str(e)
        if "EADDRINUSE" in text or "address already in use" in text.lower() or \
                getattr(e, "errno", None) == errno.EADDRINUSE:
            addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), os.environ.get("MASTER_PORT", "?")
            raise StartupError(f"the rendezvous port {addr}:{port} is in use (another job on this node?): pass "
                               "another --master_port to deepspeed, or stop the other job") from e
        raise


def _ranks(ranks: list[int], outcomes: list) -> str:
    hosts = sorted({outcomes[r][1] for r in ranks})
    return f"rank{'s' * (len(ranks) > 1)} {','.join(map(str, ranks))} on {', '.join(hosts)}"


def _seen(tags: tuple[str, ...] | None) -> str:
    return "none" if not tags else ", ".join(tags[-3:])


def agree(error: BaseException | None, view: Any, device: Any) -> None:
    """Collective (every rank, right after the rendezvous): exchange each rank's check outcome
    (``error``, None when it passed) and its ``view`` of the checkpoint root (the finished tags it
    sees; None when its config could not be read).  Raises on every rank when any rank failed:
    the failing rank its own exception, the others :class:`StartupError` naming rank, host and
    cause; when the hosts see different checkpoints, :class:`StartupError` naming that instead."""
    import torch
    import torch.distributed as dist

    if getattr(device, "type", "cpu") == "cuda":  # all_gather_object uses the current device on NCCL
        torch.cuda.set_device(device)
    mine = (f"{error}" if error is not None else "", socket.gethostname(), view)
    outcomes = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        outcomes = [None] * dist.get_world_size()
        dist.all_gather_object(outcomes, mine)
    per_host: dict[str, set] = {}
    for _, host, seen in outcomes:
        if seen is not None:
            per_host.setdefault(host, set()).add(seen)
    distinct = {next(iter(v)) for v in per_host.values() if len(v) == 1}
    if len(per_host) > 1 and all(len(v) == 1 for v in per_host.values()) and len(distinct) > 1 and \
            (() in distinct or not set.intersection(*map(set, distinct))):
        # each host agrees with itself; one sees nothing or they share no tag (a lagging shared
        # filesystem shows an older subset, not a disjoint one): the directory is node-local
        seen = "; ".join(f"{host} sees {_seen(next(iter(v)))}" for host, v in sorted(per_host.items()))
        raise StartupError(f"the nodes see different checkpoints under ds_mp.training.output_dir ({seen}): it is "
                           "node-local; checkpoints need a filesystem every node shares: put output_dir on one "
                           f"(see {SHARED_FS})") from error
    failed: dict[str, list[int]] = {}
    for rank, (msg, _, _) in enumerate(outcomes):
        if msg:
            failed.setdefault(msg, []).append(rank)
    if error is not None:
        raise error
    if failed:
        cause = "; ".join(f"{_ranks(rs, outcomes)}: {msg}" for msg, rs in failed.items())
        raise StartupError(f"a start-up check failed on another rank, so every rank stops ({cause})")


def checked_then_agreed(checks: Callable[[], Any], view: Callable[[], Any], init: Callable[[float | None], None],
                        device: Callable[[], Any]) -> Any:
    """Run ``checks`` (this rank's, no communication) and the rendezvous ``init(timeout_s)``, then
    :func:`agree` on the outcome; returns ``checks``' result when every rank passed.  ``view()``,
    called after ``checks`` whatever its outcome, is what this rank sees of the checkpoint root.

    A rank whose check failed waits at most :data:`FAILED_RENDEZVOUS_S` for its peers (they are
    there or coming: it only tells them why) and raises its own error when it has no launcher's
    rendezvous address (``MASTER_ADDR``) or no peers to tell."""
    try:
        result, error = checks(), None
    except Exception as e:  # noqa: BLE001 - every rank learns of it in agree()
        result, error = None, e
    seen = view()
    if error is not None and ("MASTER_ADDR" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) <= 1):
        raise error  # nobody to tell
    try:
        rendezvous(lambda: init(None if error is None else FAILED_RENDEZVOUS_S))
    except Exception:
        if error is not None:
            raise error from None  # the peers could not be reached: this rank's cause is the line
        raise
    agree(error, seen, device())
    return result


def check_shared_output_dir(output_dir: str, holder: str, device: Any) -> None:
    """Collective, after global rank 0 wrote ``holder`` into ``<output_dir>/ds_mp.lock``: every rank
    reads the lock back; a rank that does not find it there is on another filesystem (a node-local
    ``output_dir``): refused on every rank before anything is trained."""
    import torch.distributed as dist

    del device  # agree() made it the current one
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    ok = False
    for attempt in range(PROBE_TRIES):  # a network filesystem may show the new content a moment late
        try:
            with open(os.path.join(output_dir, LOCK)) as f:
                ok = f.read().strip() == holder.strip()
        except OSError:
            ok = False
        if ok:
            break
        time.sleep(1.0)
    outcomes = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, (ok, socket.gethostname()))
    missing = [r for r, (seen, _) in enumerate(outcomes) if not seen]
    if missing:
        where = _ranks(missing, [(None, h, None) for _, h in outcomes])
        raise StartupError(f"ds_mp.training.output_dir {output_dir!r} is not shared: {where} cannot read the lock "
                           f"global rank 0 wrote there; checkpoints need a filesystem every node shares: put output_dir on "
                           f"one (see {SHARED_FS})")


def tags_view(ckpt_root: str) -> tuple[str, ...]:
    """What this rank sees of ``ckpt_root``: its finished checkpoints (diagnostics included)."""
    return tuple(finished_tags(ckpt_root))



_NUMERIC = ("lr", "weight_decay", "eps", "momentum", "dampening")
_ADAM_ONLY = ("torch_adam", "adam_w_mode")


def check_deepspeed_blocks(raw: dict) -> None:
    """The DeepSpeed-side ``optimizer`` and ``scheduler`` blocks, checked before any collective
    (DeepSpeed itself fails on every rank with a ``TypeError`` or ``AssertionError`` deep in the
    engine): numbers that are strings, a leftover Adam-only key under another optimizer type,
    a key ``torch.optim.SGD`` does not take, a scheduler DeepSpeed does not know."""
    import difflib
    import inspect

    import torch
    from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES

    from ds_mp.config import ConfigError

    opt = raw.get("optimizer") or {}
    kind, params = str(opt.get("type", "")), opt.get("params") or {}
    for key in _NUMERIC:
        value = params.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ConfigError(f"optimizer.params.{key}: {value!r} is not a number; write it without quotes "
                              f"(e.g. \"{key}\": 0.001)")
    takes = None
    if kind.lower() == "sgd":  # DeepSpeed passes the params to torch.optim.SGD unchanged
        takes = set(inspect.signature(torch.optim.SGD).parameters) - {"params"}
    for key in params:
        if (key in _ADAM_ONLY and kind.lower() not in ("adam", "adamw")) or (takes is not None and key not in takes):
            allowed = f" (it takes {', '.join(sorted(takes))})" if takes is not None else ""
            raise ConfigError(f"optimizer.params.{key}: optimizer.type {kind!r} has no such parameter{allowed}; "
                              "remove it (a leftover of another optimizer?)")
    sched = raw.get("scheduler")
    if sched:
        name = sched.get("type")
        # DeepSpeed takes its own schedulers or, failing that, any class of torch.optim.lr_scheduler
        # (DeepSpeedEngine._scheduler_from_config)
        torch_names = [n for n in dir(torch.optim.lr_scheduler)
                       if isinstance(getattr(torch.optim.lr_scheduler, n), type) and not n.startswith("_")]
        if name not in VALID_LR_SCHEDULES and name not in torch_names:
            close = difflib.get_close_matches(str(name), [*VALID_LR_SCHEDULES, *torch_names], n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"scheduler.type: {name!r} is neither a DeepSpeed scheduler nor a class of "
                              f"torch.optim.lr_scheduler; {hint}DeepSpeed's are {', '.join(VALID_LR_SCHEDULES)}")
