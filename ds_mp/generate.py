"""``ds-mp generate``: sample text from an HF directory or a ds_mp checkpoint.

A ds_mp (sharded or training) checkpoint is first exported to a temporary HF directory,
so generation always runs through Hugging Face's own ``generate()``.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile


def _hf_dir(path: str, tmp: str) -> str:
    if os.path.isfile(os.path.join(path, "config.json")) and not os.path.isfile(
            os.path.join(path, "ds_mp_meta.json")):
        return path
    from ds_mp.checkpoint import ds_to_hf

    out = os.path.join(tmp, "hf")
    ds_to_hf(path, out, verify=False)
    return out


def generate_cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ds-mp generate", description=__doc__)
    p.add_argument("--model", required=True, help="HF GPT-2 dir, ds_mp sharded dir or training checkpoint")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir (default: the model dir)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=50)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not os.path.isdir(args.model):
        print(f"ds-mp generate: --model {args.model!r} is not a directory", file=sys.stderr)
        return 2
    import torch
    from transformers import AutoTokenizer, GPT2LMHeadModel

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _hf_dir(args.model, tmp)
        tok_dir = args.tokenizer or (model_dir if os.path.exists(os.path.join(model_dir, "tokenizer.json"))
                                     else args.model)
        try:
            tok = AutoTokenizer.from_pretrained(tok_dir)
        except (OSError, ValueError) as e:
            print(f"ds-mp generate: no tokenizer in {tok_dir!r} ({e}); pass --tokenizer DIR", file=sys.stderr)
            return 2
        model = GPT2LMHeadModel.from_pretrained(model_dir).eval()
    torch.manual_seed(args.seed)
    ids = tok(args.prompt, return_tensors="pt").input_ids
    sample = args.temperature > 0
    out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=sample,
                         temperature=args.temperature if sample else None, top_k=args.top_k if sample else None,
                         pad_token_id=tok.eos_token_id)
    print(tok.decode(out[0], skip_special_tokens=True))
    return 0
