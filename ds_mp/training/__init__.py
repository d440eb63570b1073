"""The training loop (``loop``, run by ``launch/train.py``) and its metrics (``metrics``)."""
