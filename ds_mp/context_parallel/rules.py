"""The rules of context parallelism that a configuration is checked against (pure Python, no torch:
``ds_mp.config``'s ``load_config`` calls them before any collective).

Which impl balances (:func:`balanced_for`):

* ``allgather``: each rank attends with *its own* queries over the gathered keys, so its work is the
  causal triangle's rows it holds — zigzag (``balanced=True``) evens it out.
* ``ulysses``: after the all-to-all every rank holds the *whole row* for ``h/C`` heads, so every rank
  does the same work whatever the split; contiguous (``balanced=False``) keeps the all-to-all's output
  in full-row order with no permutation.
"""
from __future__ import annotations

IMPLS = ("ulysses", "allgather")
#: The impl when ``"context_parallel"`` names none: ``allgather`` takes any head count (ulysses needs
#: the heads divisible by TP·CP), gathers only the key/value heads (GQA: a fraction of ulysses' four
#: all-to-alls of q, k, v and the output) and balances the causal work by the zigzag; docs/design.md
#: ("Context parallelism") has the measurement.
DEFAULT_IMPL = "allgather"


def balanced_for(impl: str) -> bool:
    """Whether ``impl`` holds the zigzag split (True: ``allgather``) or contiguous chunks (False:
    ``ulysses``); see the module docstring for why.  Raises ``ValueError`` for an unknown impl."""
    if impl not in IMPLS:
        raise ValueError(f"context_parallel.impl: unknown impl {impl!r}; use one of {', '.join(IMPLS)}")
    return impl == "allgather"


def check_seq_len(seq_len: int, cp: int, balanced: bool, tp: int = 1) -> None:
    """Raise ``ValueError`` (one line) unless a row of ``seq_len`` tokens splits into ``cp`` shards
    (``2·cp`` equal chunks when ``balanced``), and each shard again into ``tp`` equal slices (``tp``
    > 1: sequence parallelism cuts the shard's activations along the sequence)."""
    chunks = 2 * cp if balanced else cp
    if cp < 1 or seq_len % (chunks * tp):
        how = f"2·cp = {chunks} chunks" if balanced else f"cp = {cp} shards"
        sp = f" of {tp} sequence-parallel slices each" if tp > 1 else ""
        raise ValueError(f"context_parallel: seq_len {seq_len} does not split into {how}{sp}; use a seq_len "
                         f"divisible by {chunks * tp}")


def check_heads(n_head: int, n_kv: int, tp: int, cp: int, impl: str) -> None:
    """Raise ``ValueError`` (one line) unless ``impl`` can split the attention heads: ``ulysses``
    needs the query heads divisible by TP·CP (each CP rank of a TP rank takes ``n_head/(TP·CP)``
    after the all-to-all); key/value heads of any count follow (split with their query heads, repeated
    first where CP does not divide them: ``ds_mp.context_parallel.attention``).  ``allgather`` takes
    any head count."""
    balanced_for(impl)
    if impl == "ulysses" and n_head % (tp * cp):
        raise ValueError(f"context_parallel.impl 'ulysses': {n_head} attention heads are not divisible by "
                         f"tp·cp = {tp * cp}; use impl 'allgather' or another tp/cp")
    if n_kv < 1 or n_head % n_kv:
        raise ValueError(f"context_parallel: {n_head} attention heads are not a multiple of {n_kv} key/value heads")


__all__ = ["DEFAULT_IMPL", "IMPLS", "balanced_for", "check_heads", "check_seq_len"]
