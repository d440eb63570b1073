"""The ``ds-mp`` command-line tools (``cli`` dispatches to the others)."""
