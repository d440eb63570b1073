"""Megatron-style tensor parallelism: mappings, layers, loss, RNG, sharding rules."""
from ds_mp.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from ds_mp.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from ds_mp.tensor_parallel.mappings import (copy_to_tp, gather_from_sequence, parallel_input_linear, reduce_from_tp,
                                            reduce_scatter_to_sequence)
from ds_mp.tensor_parallel.sharding import padded_vocab_size, shard, unshard

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "vocab_parallel_cross_entropy", "copy_to_tp", "reduce_from_tp", "parallel_input_linear", "gather_from_sequence", "reduce_scatter_to_sequence",
           "padded_vocab_size", "shard", "unshard"]
