"""The one exception type of ``ds_mp.data``.

Every user-facing failure in data preparation and loading raises :class:`DataError`
with a single line that names the problem and the fix.
"""
from __future__ import annotations


class DataError(ValueError):
    """A data-preparation or data-loading problem the user can fix (one-line message)."""
