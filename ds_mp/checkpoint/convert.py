"""``ds-mp convert hf-to-ds | ds-to-hf``: HF ⇄ sharded conversion, verified by logits.

Both directions write into a temporary sibling of OUT, verify there, and rename only on
success, so a crash or a failed check leaves no OUT behind.  Conversion streams: every
shard is read as safetensors slices and written straight to its file, one tensor at a
time, so peak memory is one tensor (one full tensor for ds-to-hf), not one model.

Verification (default) re-reads the output one tensor at a time and compares it with the
source, bit-exact (padding dropped), which also streams.  ``--verify-logits`` additionally
runs two HF models (the family's ``…ForCausalLM``) on a fixed input and compares logits (max |Δ| ≤ ``--atol``)
— this holds two whole models in memory:

* hf-to-ds: ``from_pretrained(IN)`` — HF's own loader of the source, with its reading of names,
  tying and config (a config that ties the head over a stored, different ``lm_head.weight`` loads
  untied) — vs a model rebuilt from the written shards (every tensor merged back with
  ``unshard``), which checks ds_mp's reading of the source, the cut and the vocab padding (a
  sharded IN, ds_mp's own format, is rebuilt from its shards);
* ds-to-hf: a model rebuilt from the source shards vs ``from_pretrained(OUT)``, which
  checks that HF's own loader reads the export (names, tying, config) as intended.

``hf-to-ds`` also accepts a sharded directory as input, which reshards it to a new
TP × PP.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

import torch

from ds_mp.atomic import atomic_dir
from ds_mp.checkpoint.hf import HFReader, open_reader, write_hf_streaming
from ds_mp.checkpoint.sharded import CheckpointError, ShardedReader, expected_shapes, is_sharded_dir, write_sharded
from ds_mp.config.families import TRAINED
from ds_mp.hub import HubError, resolve_model
from ds_mp.models.family import family_of
from ds_mp.models.partition import stage_parts
from ds_mp.tensor_parallel.sharding import padded_vocab_size


def model_from(reader: HFReader | ShardedReader) -> Any:
    """An fp32 HF model of the reader's family holding exactly the reader's tensors."""
    model = family_of(reader.config).model_class(reader.config)(reader.config).float().eval()
    with torch.no_grad():
        for name in expected_shapes(reader.config):
            model.get_parameter(name).copy_(reader.get(name))
    return model


def hf_loaded(path: str, cfg: Any) -> Any:
    """``from_pretrained(path)`` of the family's ``…ForCausalLM`` in fp32: the HF directory as HF reads it."""
    return family_of(cfg).model_class(cfg).from_pretrained(path, dtype=torch.float32).eval()


def max_logit_diff(a: Any, b: Any, vocab: int, n_positions: int) -> float:
    """max |logits_a − logits_b| on a fixed (2, ≤16) batch of token ids."""
    T = min(16, n_positions)
    ids = (torch.arange(2 * T).view(2, T) * 7919 + 13) % vocab
    with torch.no_grad():
        return float((a(input_ids=ids).logits.float() - b(input_ids=ids).logits.float()).abs().max())


def _check(diff: float, atol: float, what: str) -> str:
    if not diff <= atol:  # also catches NaN
        raise CheckpointError(f"verification failed: {what} max |Δlogits| = {diff:.3e} > atol {atol:.1e}; "
                              "the written checkpoint does not reproduce the source (output not written)")
    return f"verified: {what} max |Δlogits| = {diff:.3e} (atol {atol:.1e})"


def _check_tensors(src: Any, out: Any, cfg: Any) -> str:
    """Compare every tensor of two readers, one at a time (bit-exact, true vocab)."""
    for name in expected_shapes(cfg):
        a, b = src.get(name), out.get(name)
        if a.dtype != b.dtype or not torch.equal(a, b):
            raise CheckpointError(f"verification failed: {name} differs between the source and the written "
                                  "checkpoint (output not written)")
    return f"verified: all {len(expected_shapes(cfg))} tensors bit-exact"


def _no_lora(reader: HFReader | ShardedReader, src: str) -> None:
    """A LoRA run's training checkpoint holds the frozen base and the factors: converting only
    the base would silently drop the fine-tuning."""
    if isinstance(reader, ShardedReader) and reader.lora:
        raise CheckpointError(f"{src}: a LoRA run's training checkpoint (ds_mp.lora {reader.lora}); its base "
                              "weights alone are not the fine-tuned model: use the run's <output_dir>/hf "
                              "(merged) or <output_dir>/adapter, or ds_mp.save_lora after resuming it")


def hf_to_ds(src: str, out: str, tp: int, pp: int, partition: str | list[int] = "uniform", vocab_pad_multiple: int = 128,
             verify: bool = True, atol: float = 1e-5, overwrite: bool = False, verify_logits: bool = False) -> str:
    """Write ``src`` (HF or sharded dir) as a sharded directory for TP=``tp``, PP=``pp``."""
    reader = open_reader(src)
    _no_lora(reader, src)
    cfg = reader.config
    heads, L, family = cfg.num_attention_heads, cfg.num_hidden_layers, family_of(cfg)
    if tp < 1 or heads % tp:
        raise CheckpointError(f"--tp {tp} does not divide n_head={heads}; use a divisor of {heads}")
    inner = getattr(cfg, "intermediate_size", 0) or 0  # the Llama family's MLP width (equal column blocks)
    if inner % tp:
        raise CheckpointError(f"--tp {tp} does not divide intermediate_size={inner}; use a divisor of it")
    if pp < 1 or pp > L:
        raise CheckpointError(f"--pp {pp}: need 1 <= stages <= n_layer={L}")
    if vocab_pad_multiple < 1:
        raise CheckpointError(f"--vocab-pad-multiple {vocab_pad_multiple}: must be >= 1")
    _check_partition(partition, pp, L)
    parts = stage_parts(L, pp, partition, cfg.hidden_size, cfg.vocab_size, lead=family.lead_layers,
                        tail=family.tail_layers, block_params=family.block_parameters(cfg))
    padded = padded_vocab_size(cfg.vocab_size, tp, vocab_pad_multiple)
    with atomic_dir(out, overwrite=overwrite) as tmp:
        write_sharded(reader, cfg, tmp, tp, parts, padded)
        msg = f"wrote {out} (tp={tp}, pp={pp}, parts={parts}, vocab {cfg.vocab_size} padded to {padded})"
        if verify:
            msg += "; " + _check_tensors(reader, ShardedReader(tmp), cfg)
        if verify_logits:
            sharded_in = isinstance(reader, ShardedReader)
            source = model_from(reader) if sharded_in else hf_loaded(src, cfg)
            diff = max_logit_diff(source, model_from(ShardedReader(tmp)), cfg.vocab_size, cfg.max_position_embeddings)
            msg += "; " + _check(diff, atol, "source shards vs shards" if sharded_in else "from_pretrained(IN) vs shards")
    return msg


def _check_partition(partition: str | list[int], pp: int, n_layer: int) -> None:
    if partition == "cost":
        raise CheckpointError("--partition cost is measured when training starts (ds_mp.initialize); a checkpoint "
                              "loads at any partition, so convert with uniform, or give the run's blocks per stage "
                              "(e.g. --partition 5,3)")
    if isinstance(partition, list) and (len(partition) != pp or sum(partition) != n_layer or min(partition) < 0
                                        or any(n < 1 for n in partition[1:-1])):
        raise CheckpointError(f"--partition {','.join(map(str, partition))}: need {pp} block counts summing to "
                              f"n_layer={n_layer}, at least 1 for every middle stage")


def partition_arg(text: str) -> str | list[int]:
    """``--partition``: ``uniform``, ``parameters``, ``cost`` or blocks per stage (``5,3``)."""
    if text in ("uniform", "parameters", "cost"):
        return text
    try:
        return [int(n) for n in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not uniform, parameters or blocks per stage "
                                         "such as 5,3") from None


def ds_to_hf(src: str, out: str, tokenizer_dir: str | None = None, verify: bool = True, atol: float = 1e-5,
             overwrite: bool = False, verify_logits: bool = False) -> str:
    """Write the sharded directory ``src`` as an HF model directory (vocab padding removed)."""
    if not is_sharded_dir(src):
        raise CheckpointError(f"{src}: not a ds_mp sharded checkpoint (no ds_mp_meta.json)")
    reader = ShardedReader(src)
    _no_lora(reader, src)
    cfg = reader.config
    with atomic_dir(out, overwrite=overwrite) as tmp:
        write_hf_streaming(reader, cfg, tmp, tokenizer_dir)
        msg = f"wrote {out} (from tp={reader.tp}, pp={len(reader.parts) - 1})"
        if verify:
            msg += "; " + _check_tensors(reader, HFReader(tmp), cfg)
        if verify_logits:
            diff = max_logit_diff(model_from(reader), hf_loaded(tmp, cfg), cfg.vocab_size, cfg.max_position_embeddings)
            msg += "; " + _check(diff, atol, "shards vs from_pretrained")
    return msg


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds-mp convert", description=f"Convert HF causal-LM checkpoints ({TRAINED}) "
                                "between the Hugging Face layout and ds_mp's sharded layout (any TP × PP).")
    sub = p.add_subparsers(dest="direction", required=True)
    a = sub.add_parser("hf-to-ds", help="HF directory, Hub id (gpt2, org/name@rev) or sharded dir -> sharded directory")
    a.add_argument("src", metavar="IN")
    a.add_argument("out", metavar="OUT")
    a.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (divides n_head)")
    a.add_argument("--pp", type=int, default=1, help="pipeline stages (<= n_layer)")
    a.add_argument("--partition", default="uniform", type=partition_arg,
                   help="uniform, parameters, or blocks per stage such as 5,3 (the checkpoint loads at any partition)")
    a.add_argument("--vocab-pad-multiple", type=int, default=128, help="vocab padded to a multiple of this × TP")
    b = sub.add_parser("ds-to-hf", help="sharded directory -> HF directory (from_pretrained-ready)")
    b.add_argument("src", metavar="IN")
    b.add_argument("out", metavar="OUT")
    b.add_argument("--tokenizer", metavar="DIR", help="copy tokenizer files from this directory")
    for sp in (a, b):
        sp.add_argument("--no-verify", action="store_true", help="skip the tensor-by-tensor comparison")
        sp.add_argument("--verify-logits", action="store_true",
                        help="also compare logits of two HF models (holds two whole models in memory)")
        sp.add_argument("--atol", type=float, default=1e-5, help="max |Δlogits| accepted by --verify-logits")
        sp.add_argument("--force", action="store_true", help="replace OUT if it exists")
    return p


def convert_cli(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``ds-mp convert``; returns the exit code (0 ok, 1 error)."""
    args = build_parser().parse_args(argv)
    common = {"verify": not args.no_verify, "atol": args.atol, "overwrite": args.force,
              "verify_logits": args.verify_logits}
    try:
        if args.direction == "hf-to-ds":
            src = resolve_model(args.src, "ds-mp convert hf-to-ds IN")  # an HF dir or a Hub id
            msg = hf_to_ds(src, args.out, args.tp, args.pp, args.partition, args.vocab_pad_multiple, **common)
        else:
            msg = ds_to_hf(args.src, args.out, args.tokenizer, **common)
    except (CheckpointError, FileExistsError, HubError) as e:
        print(f"ds-mp convert: error: {e}", file=sys.stderr)
        return 1
    print(f"ds-mp convert {args.direction}: {msg}")
    return 0
