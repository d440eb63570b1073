"""The ``context_parallel`` block at ``load_config``: its degree enters the world-size arithmetic (dp =
world / (TP·PP·CP)), and each bad input is refused in one line naming the key, before any collective."""
from __future__ import annotations

import pytest
import torch

from ds_mp.config import ConfigError, load_config

GPT2 = {"n_layer": 2, "n_embd": 16, "n_head": 4, "vocab_size": 64, "n_positions": 64}
LLAMA = {**GPT2, "model_type": "llama", "n_kv_head": 2}


def _cfg(cp: dict, *, model: dict = GPT2, seq: int = 16, tp: int = 1, sp: bool = False, pp: int = 1,
         schedule: str = "1f1b", **ds_mp) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "ds_mp": {"model": model, "data": {"seq_len": seq}, "context_parallel": cp,
                      "tensor_parallel": {"size": tp, "sequence_parallel": sp},
                      "pipeline": {"stages": pp, "schedule": schedule}, **ds_mp}}


def test_context_parallel_degrees() -> None:
    cfg, _ = load_config(_cfg({"size": 2}), world_size=8)
    assert (cfg.cp, cfg.dp, cfg.context_parallel.impl) == (2, 4, "allgather")  # dp: the ranks reading distinct rows
    cfg, _ = load_config(_cfg({"size": 2, "impl": "ulysses"}, tp=2, pp=2, sp=True), world_size=16)
    assert (cfg.tp, cfg.pp, cfg.cp, cfg.dp) == (2, 2, 2, 2)
    assert load_config(_cfg({}), world_size=4)[0].cp == 1


@pytest.mark.parametrize("cp, kwargs, world, words", [
    ({"size": 2}, {"tp": 2}, 6, "ds_mp: world size 6 is not divisible by tensor_parallel.size (2) × pipeline.stages "
                                "(1) × context_parallel.size (2) = 4"),
    ({"size": 0}, {}, 2, "ds_mp.context_parallel.size: must be >= 1"),
    ({"size": 2, "impl": "ring"}, {}, 2, "ds_mp.context_parallel.impl: 'ring' is unknown"),
    ({"size": 2, "mode": "x"}, {}, 2, "ds_mp.context_parallel.mode: unknown key"),
    ({"size": 2}, {"seq": 18}, 2, "ds_mp.data.seq_len: context_parallel: seq_len 18 does not split into 2·cp = 4"),
    ({"size": 2, "impl": "ulysses"}, {"seq": 17}, 2, "ds_mp.data.seq_len: context_parallel: seq_len 17 does not "
                                                      "split into cp = 2 shards"),
    ({"size": 2}, {"seq": 20, "tp": 2, "sp": True}, 4, "sequence-parallel slices"),
    ({"size": 4, "impl": "ulysses"}, {"tp": 2}, 8, "ds_mp.context_parallel.impl: context_parallel.impl 'ulysses': 4 "
                                                   "attention heads are not divisible by tp·cp = 8"),
    ({"size": 2}, {"training": {"noise_scale_interval": 2}}, 4, "ds_mp.training.noise_scale_interval: the gradient "
                                                                "noise scale is not measured under context parallelism"),
    ({"size": 2}, {"pp": 2, "schedule": "terapipe"}, 4, "ds_mp.context_parallel: not supported with the terapipe"),
    ({"size": 2}, {"pp": 2, "schedule": "ouroboros", "model": {**GPT2, "n_layer": 4}}, 4, "ds_mp.context_parallel: not supported with the ouroboros"),
])
def test_bad_context_parallel_is_refused_in_one_line(cp: dict, kwargs: dict, world: int, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(_cfg(cp, **kwargs), world_size=world)
    msg = str(err.value)
    assert msg.startswith(words) or words in msg, msg
    assert "\n" not in msg


def test_ulysses_takes_replicated_kv_heads_and_allgather_any_heads() -> None:
    """Ulysses at TP·CP = 4 with 2 KV heads (replicated), allgather with 3 heads at CP = 2."""
    load_config(_cfg({"size": 2, "impl": "ulysses"}, model=LLAMA, tp=2), world_size=4)
    load_config(_cfg({"size": 2}, model={**GPT2, "n_head": 2, "n_embd": 18}), world_size=2)


def test_cp_ranks_draw_their_own_dropout_streams() -> None:
    """CP peers hold different tokens of the same rows: their default and TP streams differ (else token
    i of every shard would get the same dropout mask); cp_rank 0 keeps the seeds of a run without CP."""
    from ds_mp.tensor_parallel.random import seed_everything

    assert seed_everything(7, 1, 2, cp_rank=0) == seed_everything(7, 1, 2)
    one = seed_everything(7, 1, 2, cp_rank=1)
    assert set(one.values()).isdisjoint(seed_everything(7, 1, 2).values())
    draws = []
    for cp_rank in (0, 1):
        seed_everything(7, 1, 2, cp_rank=cp_rank)
        draws.append(torch.rand(4))
    assert not torch.equal(*draws)
