"""The loss slot (``ds_mp.losses.spec``): one :class:`LossSpec` per loss, chosen by
``"ds_mp": {"loss": {"type": NAME}}``; the per-token LM loss (``ds_mp.losses.lm``) is the first."""
from ds_mp.losses.lm import LM_LOSS, LMLossSpec, shift_labels
from ds_mp.losses.spec import IGNORE, BoundLoss, LossSpec

__all__ = ["IGNORE", "BoundLoss", "LossSpec", "LMLossSpec", "LM_LOSS", "shift_labels"]
