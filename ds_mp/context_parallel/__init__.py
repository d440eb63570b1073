"""Context parallelism: a sequence split over the ranks of a CP group.

``rules`` (pure Python, importable by ``ds_mp.config``): the impls, which split each holds, the
seq_len and head-count checks.  ``shard`` (torch): which tokens each CP rank holds.  ``attention``
(torch.distributed): the attention ops that exchange keys/values or heads over the group.  Same
floor as ``ds_mp.tensor_parallel`` (``rules`` on the ground floor, with ``ds_mp.config``)."""
from ds_mp.context_parallel.rules import DEFAULT_IMPL, IMPLS, balanced_for, check_heads, check_seq_len

__all__ = ["DEFAULT_IMPL", "IMPLS", "balanced_for", "check_heads", "check_seq_len"]
