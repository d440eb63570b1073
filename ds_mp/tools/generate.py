"""``ds-mp generate``: sample text from an HF directory or a ds_mp checkpoint.

A ds_mp checkpoint (a sharded directory from ``ds-mp convert hf-to-ds``, a training
checkpoint ``<output_dir>/checkpoints/<tag>``, or ``<output_dir>/checkpoints`` itself,
which means its ``latest``) is first exported to a temporary HF directory, so generation
always runs through Hugging Face's own ``generate()``.  :func:`hf_model_dir` and
:func:`default_tokenizer_dir` are shared with ``ds-mp eval``.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile


def hf_model_dir(path: str, tmp: str) -> str:
    """An HF GPT-2 directory holding the model at ``path``: ``path`` itself if it is one,
    else an export (``ds_to_hf``) of the ds_mp checkpoint into ``tmp``."""
    from ds_mp.checkpoint import CheckpointError, ds_to_hf
    from ds_mp.checkpoint.sharded import is_sharded_dir
    from ds_mp.checkpoint.training import NATIVE, resolve_checkpoint

    path = resolve_checkpoint(path)  # a checkpoint root: follow its pointer
    if os.path.isfile(os.path.join(path, NATIVE)):
        raise CheckpointError(f"{path}: a bf16/ZeRO checkpoint in DeepSpeed's own format (written by an older "
                              "ds_mp) cannot be exported offline; use the HF directory training wrote to <output_dir>/hf")
    if is_sharded_dir(path):
        out = os.path.join(tmp, "hf")
        ds_to_hf(path, out, verify=False)
        return out
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    raise CheckpointError(f"{path}: neither an HF directory (config.json) nor a ds_mp checkpoint "
                          "(ds_mp_meta.json or a 'latest' file); pass one of those")


def resolve_model(prog: str, model: str, tokenizer: str | None, tmp: str) -> tuple[str, str] | None:
    """``(HF model dir, tokenizer dir)`` for ``--model`` / ``--tokenizer`` of a CLI, or None after
    printing ``prog: <why>`` (a checkpoint that cannot be exported, ...)."""
    from ds_mp.checkpoint import CheckpointError
    from ds_mp.hub import HubError
    from ds_mp.hub import resolve_model as hub_model

    try:
        model = hub_model(model, "--model")  # a Hub id: its cached snapshot
        model_dir = hf_model_dir(model, tmp)
    except (CheckpointError, HubError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return None
    return model_dir, tokenizer or default_tokenizer_dir(model, model_dir) or model


def default_tokenizer_dir(path: str, hf_dir: str) -> str | None:
    """Where the tokenizer of the model at ``path`` lives: the HF directory if it holds one,
    else (training checkpoints) the tokenizer of the dataset it was trained on."""
    from ds_mp.checkpoint.integrity import Manifest, load_torch
    from ds_mp.checkpoint.training import TRAINER_STATE, resolve_checkpoint
    from ds_mp.data import DataError, DatasetInfo

    if os.path.isfile(os.path.join(hf_dir, "tokenizer.json")) or os.path.isfile(os.path.join(hf_dir, "vocab.json")):
        return hf_dir
    path = resolve_checkpoint(path)
    state = os.path.join(path, TRAINER_STATE)
    if not os.path.isfile(state):
        return None
    data = load_torch(state, Manifest.open(path)).get("client_state", {}).get("data")  # checked: names a damaged file
    try:
        return DatasetInfo.load(data).tokenizer_dir if data else None
    except DataError:
        return None


def generate_cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ds-mp generate", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF GPT-2 dir, Hub id, ds_mp sharded dir or training checkpoint")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer dir (default: the model dir, or a training checkpoint's dataset tokenizer)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=50)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from ds_mp.hub import parse_model_id

    if not os.path.isdir(args.model) and parse_model_id(args.model) is None:
        print(f"ds-mp generate: --model {args.model!r} is neither a directory nor a Hub id", file=sys.stderr)
        return 2
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        dirs = resolve_model("ds-mp generate", args.model, args.tokenizer, tmp)
        if dirs is None:
            return 2
        model_dir, tok_dir = dirs
        try:
            tok = AutoTokenizer.from_pretrained(tok_dir)
        except (OSError, ValueError) as e:
            print(f"ds-mp generate: no tokenizer in {tok_dir!r} ({e}); pass --tokenizer DIR", file=sys.stderr)
            return 2
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()  # GPT-2, Llama, Qwen2, Mistral
    torch.manual_seed(args.seed)
    ids = tok(args.prompt, return_tensors="pt").input_ids
    sample = args.temperature > 0
    out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=sample,
                         temperature=args.temperature if sample else None, top_k=args.top_k if sample else None,
                         pad_token_id=tok.eos_token_id)
    print(tok.decode(out[0], skip_special_tokens=True))
    return 0
