"""The ``"ds_mp"`` block: every recipe validates, every bad config fails in one clear line."""
from __future__ import annotations

import copy
import glob
import json
import os
import re

import pytest

from ds_mp import ConfigError, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = sorted(glob.glob(os.path.join(ROOT, "ds_configs", "*.json")))

# Used when ds_configs/ holds no recipe yet: a complete TP=2 × PP=2 × DP=2 job.
DEFAULT = {
    "train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
    "optimizer": {"type": "SGD", "params": {"lr": 0.01}}, "gradient_clipping": 1.0,
    "steps_per_print": 100,
    "ds_mp": {"model": {"n_layer": 4, "n_embd": 48, "n_head": 6, "vocab_size": 1003, "n_positions": 64},
              "tensor_parallel": {"size": 2, "sequence_parallel": True},
              "pipeline": {"stages": 2, "schedule": "gpipe", "partition": [1, 3]},
              "data": {"seq_len": 32}, "training": {"steps": 10}},
}

# A GPT-2 small config.json, standing in for a recipe's HF directory that is not on disk.
GPT2_SMALL = {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257,
              "n_positions": 1024, "resid_pdrop": 0.1}


def _implied_dp(raw: dict, name: str) -> int:
    """DP from ``train_batch_size`` (= micro × GAS × DP) or a ``dpN`` in the file name."""
    if "train_batch_size" in raw:
        micro = raw.get("train_micro_batch_size_per_gpu", 1) * raw.get("gradient_accumulation_steps", 1)
        return raw["train_batch_size"] // micro
    m = re.search(r"dp(\d+)", name)
    return int(m.group(1)) if m else 1


def _trainer_autos_filled(raw: dict) -> dict:
    """A Trainer recipe (``ds_configs/trainer_*.json``) leaves batch and clipping keys ``"auto"``:
    ``ds_mp.hf.args.deepspeed_dict`` fills them from ``TrainingArguments`` (tests/test_hf_trainer.py
    runs that path); here they take the arguments' defaults (8 rows, no accumulation, clipping 1.0)
    and ``train_batch_size`` is dropped, as ds_mp.hf derives it from DP."""
    if "auto" not in raw.values():
        return raw
    defaults = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0}
    filled = {k: defaults.get(k, v) if v == "auto" else v for k, v in raw.items() if k != "train_batch_size"}
    assert "auto" not in filled.values(), [k for k, v in filled.items() if v == "auto"]
    return filled


def _with_model_stub(raw: dict, tmp_path) -> dict:
    model = raw.get("ds_mp", {}).get("model")
    if isinstance(model, str) and not os.path.isfile(os.path.join(model, "config.json")):
        (tmp_path / "config.json").write_text(json.dumps(GPT2_SMALL))
        raw = copy.deepcopy(raw)
        raw["ds_mp"]["model"] = str(tmp_path)
    return raw


@pytest.mark.parametrize("recipe", RECIPES or ["<built-in default>"], ids=os.path.basename)
def test_recipe_validates_and_deepspeed_accepts_it(recipe: str, tmp_path) -> None:
    from deepspeed.runtime.config import DeepSpeedConfig

    builtin = recipe.startswith("<")
    on_disk = DEFAULT if builtin else json.load(open(recipe))
    original = _trainer_autos_filled(on_disk)
    raw = _with_model_stub(original, tmp_path)
    block = raw.get("ds_mp", {})
    tp = block.get("tensor_parallel", {}).get("size", 1)
    pp = block.get("pipeline", {}).get("stages", 1)
    dp = _implied_dp(raw, os.path.basename(recipe))
    cfg, full = load_config(recipe if raw is on_disk and not builtin else raw, tp * pp * dp)
    assert (cfg.tp, cfg.pp, cfg.dp) == (tp, pp, dp)
    assert cfg.shape is not None and cfg.shape.n_head % cfg.tp == 0
    # DeepSpeed ignores the unknown top-level "ds_mp" key; train_batch_size is checked
    # against DP by DeepSpeed at launch, so here (1 process) it is derived instead.
    ds = DeepSpeedConfig({k: v for k, v in full.items() if k != "train_batch_size"})
    assert ds.train_micro_batch_size_per_gpu == raw.get("train_micro_batch_size_per_gpu", 1)
    assert "ds_mp" in ds._param_dict


def _base() -> dict:
    return {"train_micro_batch_size_per_gpu": 1,
            "ds_mp": {"model": {"n_layer": 4, "n_embd": 48, "n_head": 4, "vocab_size": 203, "n_positions": 64},
                      "data": {"seq_len": 32}}}


def _bad(**edits) -> dict:
    """``_base()`` with ``edits`` (``"pipeline.stages": 3``) applied inside the ds_mp block."""
    raw = _base()
    for path, value in edits.items():
        node = raw["ds_mp"]
        *parents, leaf = path.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return raw


# (name, config, world size, fragments the one-line message must contain: key, then fix)
BAD = [
    ("unknown_key", _bad(tensor_paralel={"size": 2}), 1, ["ds_mp.tensor_paralel", "did you mean 'tensor_parallel'"]),
    ("unknown_nested_key", _bad(tensor_parallel__sequence_paralel=True), 1,
     ["ds_mp.tensor_parallel.sequence_paralel", "did you mean 'sequence_parallel'"]),
    ("wrong_type", _bad(tensor_parallel__size="2"), 2, ["ds_mp.tensor_parallel.size", "expected an integer"]),
    ("wrong_type_bool", _bad(tensor_parallel__sequence_parallel=1), 1,
     ["ds_mp.tensor_parallel.sequence_parallel", "expected true or false"]),
    ("zero_stages", _bad(pipeline__stages=0), 1, ["ds_mp.pipeline.stages", ">= 1"]),
    ("negative_tp", _bad(tensor_parallel__size=-2), 1, ["ds_mp.tensor_parallel.size", ">= 1"]),
    ("zero_micro_batch", {**_base(), "train_micro_batch_size_per_gpu": 0}, 1,
     ["train_micro_batch_size_per_gpu", "positive integer"]),
    ("tp_not_dividing_heads", _bad(tensor_parallel__size=3), 3,
     ["ds_mp.tensor_parallel.size", "does not divide n_head=4", "use a divisor of 4"]),
    ("world_size_mismatch", _bad(tensor_parallel__size=2, pipeline__stages=2), 6,
     ["world size 6", "tensor_parallel.size", "pipeline.stages", "multiple of 4"]),
    ("more_stages_than_blocks", _bad(pipeline__stages=5), 5, ["ds_mp.pipeline.stages", "at most 4 stages"]),
    ("partition_length", _bad(pipeline__stages=2, pipeline__partition=[1, 1, 2]), 2,
     ["ds_mp.pipeline.partition", "expected 2 non-negative integers"]),
    ("partition_sum", _bad(pipeline__stages=2, pipeline__partition=[1, 2]), 2,
     ["ds_mp.pipeline.partition", "sums to 3", "make them sum to 4"]),
    ("partition_empty_middle_stage", _bad(pipeline__stages=3, pipeline__partition=[2, 0, 2]), 3,
     ["ds_mp.pipeline.partition", "middle stage 1", "at least 1 block"]),
    ("partition_name", _bad(pipeline__partition="even"), 1, ["ds_mp.pipeline.partition", "'uniform'", "'cost'"]),
    ("partition_cost_ouroboros", _bad(pipeline__schedule="ouroboros", pipeline__partition="cost"), 1,
     ["ds_mp.pipeline.partition", "'cost'", "ouroboros.split", "remove pipeline.partition"]),
    ("unknown_schedule", _bad(pipeline__schedule="gpipee"), 1,
     ["ds_mp.pipeline.schedule", "'gpipee'", "; did you mean 'gpipe'"]),
    ("zb_max_pending_w", _bad(pipeline__schedule="zb-h1", pipeline__stages=2, pipeline__zb_max_pending_w="most"), 2,
     ["ds_mp.pipeline.zb_max_pending_w", "'most'", "'auto', 'paper' or an int >= 0"]),
    ("slices_sum", _bad(terapipe__slices=[8, 8]), 1, ["ds_mp.terapipe.slices", "sums to 16", "sum to 32"]),
    ("ouroboros_k_below_2", _bad(pipeline__schedule="ouroboros", ouroboros__modules=1), 1,
     ["ds_mp.ouroboros.modules", "K=1 < 2"]),
    ("ouroboros_recompute_unknown", _bad(pipeline__schedule="ouroboros", ouroboros__recompute="never"), 1,
     ["ds_mp.ouroboros.recompute", "'never'", "'none'"]),
    ("ouroboros_kept_graph_fresh_masks", _bad(pipeline__schedule="ouroboros", ouroboros__recompute="none",
                                              ouroboros__repeat_dropout=False), 1,
     ["ds_mp.ouroboros.repeat_dropout", "recompute 'none'", "'stashed'"]),
    ("ouroboros_k_vs_stages", _bad(pipeline__schedule="ouroboros", pipeline__stages=3, ouroboros__modules=3), 3,
     ["ds_mp.ouroboros.modules", "set pipeline.stages to 2"]),
    ("seq_len_over_positions", _bad(data__seq_len=65), 1, ["ds_mp.data.seq_len", "n_positions=64", "lower seq_len"]),
    ("dropout_range", _bad(model__dropout=1.5), 1, ["ds_mp.model.dropout", "[0, 1)"]),
    ("trace_steps_order", _bad(training__trace_steps=[5, 3]), 1, ["ds_mp.training.trace_steps", "first <= last"]),
    ("trace_steps_past_end", _bad(training__steps=10, training__trace_steps=[9, 11]), 1,
     ["ds_mp.training.trace_steps", "training.steps=10", "[10, 12]"]),
    ("lora_target", _bad(lora={"r": 8, "target_modules": ["q_proj"]}), 1,
     ["ds_mp.lora.target_modules", "['q_proj']", "choose from c_attn"]),
    ("lora_negative_r", _bad(lora={"r": -1}), 1, ["ds_mp.lora.r", ">= 0"]),
    ("lora_dropout", _bad(lora={"r": 8, "dropout": 1.0}), 1, ["ds_mp.lora.dropout", "[0, 1)"]),
    ("lora_sequence_parallel", _bad(lora={"r": 8}, tensor_parallel={"size": 2, "sequence_parallel": True}), 2,
     ["ds_mp.lora", "sequence_parallel to false"]),
    ("lora_ouroboros", _bad(lora={"r": 8}, pipeline={"stages": 1, "schedule": "ouroboros"}), 1,
     ["ds_mp.lora", "ouroboros"]),
    ("trace_steps_shape", _bad(training__trace_steps=[3]), 1, ["ds_mp.training.trace_steps", "[first, last]"]),
]


@pytest.mark.parametrize("name, raw, world, fragments", BAD, ids=[b[0] for b in BAD])
def test_bad_config_one_line_error(name: str, raw: dict, world: int, fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(raw, world)
    msg = str(err.value)
    assert "\n" not in msg, f"{name}: multi-line error {msg!r}"
    for fragment in fragments:
        assert fragment in msg, f"{name}: {fragment!r} not in {msg!r}"


def test_malformed_json_file(tmp_path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 1,\n "ds_mp": {"pipeline": {"stages": 2,}}}')
    with pytest.raises(ConfigError) as err:
        load_config(str(path), 2)
    msg = str(err.value)
    assert "\n" not in msg and str(path) in msg and "not valid JSON" in msg and "line 2" in msg


def test_missing_file_and_model_dir_without_config_json(tmp_path) -> None:
    with pytest.raises(ConfigError, match="not found; pass --deepspeed_config"):
        load_config(str(tmp_path / "nope.json"), 1)
    with pytest.raises(ConfigError) as err:
        load_config({"ds_mp": {"model": str(tmp_path)}}, 1)
    msg = str(err.value)
    assert "\n" not in msg and "ds_mp.model" in msg and "has no config.json" in msg and "save_pretrained" in msg


def test_hf_model_dir_and_defaults(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**GPT2_SMALL, "n_layer": 2}))
    cfg, _ = load_config({"ds_mp": {"model": str(tmp_path), "tensor_parallel": {"size": 4}}}, 8)
    assert (cfg.shape.n_layer, cfg.shape.n_head, cfg.tp, cfg.pp, cfg.dp) == (2, 12, 4, 1, 2)
    cfg, raw = load_config({}, 1)  # no ds_mp block at all: plain single-rank defaults
    assert (cfg.tp, cfg.pp, cfg.dp, cfg.pipeline.schedule) == (1, 1, 1, "1f1b") and raw == {}


def test_absent_gradient_clipping_warns_with_deepspeeds_default(monkeypatch) -> None:
    """DeepSpeed clips at 1.0 without the key (issue 43 item 15): rank 0 says so in one line;
    a config that names the key (any value, 0.0 included) is silent."""
    import warnings

    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

    from ds_mp.config.checks import DEEPSPEED_CLIPPING_DEFAULT

    assert DEEPSPEED_CLIPPING_DEFAULT == GRADIENT_CLIPPING_DEFAULT  # the number the warning states is DeepSpeed's
    absent = {k: v for k, v in copy.deepcopy(DEFAULT).items() if k != "gradient_clipping"}
    monkeypatch.setenv("RANK", "0")
    with pytest.warns(UserWarning, match=r"gradient_clipping: absent, so DeepSpeed's default 1.0 applies") as caught:
        load_config(absent, 8)
    assert all("\n" not in str(w.message) for w in caught)
    for raw, rank in ((absent, "1"), ({**absent, "gradient_clipping": 0.0}, "0")):
        monkeypatch.setenv("RANK", rank)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            load_config(raw, 8)
