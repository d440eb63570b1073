"""Checkpoints: HF ⇄ sharded conversion at any TP × PP, resharding resume, HF export.

* :mod:`~ds_mp.checkpoint.hf`: read HF/sharded directories (``directory_source``), write
  HF directories, ``save_hf`` from a running engine.
* :mod:`~ds_mp.checkpoint.sharded`: the layout-free sharded format and its reader.
* :mod:`~ds_mp.checkpoint.training`: ``save_checkpoint`` / ``load_checkpoint`` with
  optimizer state, resumable at another TP × PP × DP.
* :mod:`~ds_mp.checkpoint.convert`: ``ds-mp convert`` (``convert_cli``).
* ``ds_mp.atomic`` (ground floor, shared with ``data``): crash-safe directory writes.
"""
from ds_mp.atomic import atomic_dir
from ds_mp.checkpoint.convert import convert_cli, ds_to_hf, hf_to_ds
from ds_mp.checkpoint.hf import directory_source, save_hf
from ds_mp.checkpoint.sharded import CheckpointError, ShardedReader
from ds_mp.checkpoint.training import load_checkpoint, save_checkpoint

__all__ = ["atomic_dir", "convert_cli", "hf_to_ds", "ds_to_hf", "directory_source", "save_hf",
           "CheckpointError", "ShardedReader", "save_checkpoint", "load_checkpoint"]
