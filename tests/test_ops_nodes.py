"""Two nodes, emulated in-process (issue 43, items 2 and 3): two ranks on loopback, each with its
own hostname and its own disk (a per-rank config naming a per-rank directory), through the same
code path a real job takes (``ds_mp.training.loop.main``: checks, rendezvous, agreement, lock).

On main b45273d a check that failed on one node left the other waiting in the rendezvous until
its timeout (here ``DS_MP_TIMEOUT`` = 120 s; 300 s by default) and dying without a cause; a
``--resume`` with the checkpoint on one node's disk told that node to "run without --resume
first"; a node-local ``output_dir`` trained to the first checkpoint and then failed on ENOENT.
"""
from __future__ import annotations

import json
import os
import time

import pytest
from dist_utils import run_ranks
from launcher_utils import loop_rank, tiny_dataset, train_config
from test_ops_startup import _errors

pytestmark = [pytest.mark.serial, pytest.mark.timeout(600)]  # bounds the time every node takes to end

#: The docs promise every node ends within 30 s of a failed start-up check; the bound leaves room
#: for a busy 2-core machine (importing torch and DeepSpeed is most of it) and stays far below
#: the rendezvous timeout the ranks would otherwise wait out.
END_BOUND_S = 60


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    return tiny_dataset(str(tmp_path_factory.mktemp("nodes")))


def _node(rank: int, configs: list[str], args: list[str]) -> tuple[int, str, float]:
    """Rank program on "node<rank>" (its own hostname): the loop with this node's config."""
    import socket

    socket.gethostname = lambda: f"node{rank}"
    t0 = time.time()
    rc, err = loop_rank(rank, configs[rank], args)
    return rc, err, time.time() - t0


def _configs(tmp: str, data: str, per_node: list[dict]) -> list[str]:
    paths = []
    for rank, over in enumerate(per_node):
        cfg = train_config(tmp, data, steps=4, training={"export_hf": False, "eval_interval": 0, **over.get("t", {})})
        cfg["ds_mp"]["data"]["path"] = over.get("data", data)
        paths.append(os.path.join(tmp, f"node{rank}.json"))
        with open(paths[-1], "w") as f:
            json.dump(cfg, f)
    return paths


def _ended_with(results: list, *wanted: str) -> list[str]:
    """Every node exited 2 within the bound with one line holding each of ``wanted``."""
    lines = []
    for rank, (rc, err, secs) in enumerate(results):
        got = _errors(err)
        assert rc == 2 and len(got) == 1, f"node{rank}: exit {rc}\n{err[-3000:]}"
        assert secs < END_BOUND_S, f"node{rank} took {secs:.0f} s"
        assert all(w in got[0] for w in wanted), got[0]
        lines.append(got[0])
    return lines


def test_dataset_on_one_node_only_ends_both_naming_it(data, tmp_path):
    tmp = str(tmp_path)
    missing = os.path.join(tmp, "node1-disk", "data")
    results = run_ranks(_node, 2, _configs(tmp, data, [{}, {"data": missing}]), [], timeout=300)
    lines = _ended_with(results, missing)
    assert "a start-up check failed on another rank" in lines[0] and "rank 1 on node1" in lines[0], lines[0]


def test_resume_with_the_checkpoint_on_one_node_says_node_local(data, tmp_path):
    tmp = str(tmp_path)
    first = train_config(tmp, data, pp=1, steps=2, training={"export_hf": False, "eval_interval": 0,
                                                             "output_dir": os.path.join(tmp, "node0-disk", "run")})
    with open(os.path.join(tmp, "first.json"), "w") as f:
        json.dump(first, f)
    assert run_ranks(loop_rank, 1, os.path.join(tmp, "first.json"), [], timeout=240)[0][0] == 0
    configs = _configs(tmp, data, [{"t": {"output_dir": os.path.join(tmp, f"node{r}-disk", "run")}} for r in (0, 1)])
    results = run_ranks(_node, 2, configs, ["--resume"], timeout=300)
    lines = _ended_with(results, "node0 sees step2; node1 sees none", "node-local", "filesystem every node shares")
    assert not any("run without --resume" in x for x in lines), lines


def test_node_local_output_dir_is_refused_before_training(data, tmp_path):
    tmp = str(tmp_path)
    configs = _configs(tmp, data, [{"t": {"output_dir": os.path.join(tmp, f"node{r}-disk", "run")}} for r in (0, 1)])
    results = run_ranks(_node, 2, configs, [], timeout=300)
    _ended_with(results, "is not shared: rank 1 on node1", "filesystem every node shares")
    assert not os.path.exists(os.path.join(tmp, "node0-disk", "run", "checkpoints"))
    assert not os.path.exists(os.path.join(tmp, "node0-disk", "run", "log.csv"))
