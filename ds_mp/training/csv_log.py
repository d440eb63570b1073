"""``<output_dir>/log.csv``: one row per logged step, continued across resumes without duplicates."""
from __future__ import annotations

import csv
import io
import os
from typing import Any

from ds_mp.atomic import write_text_atomic
from ds_mp.training.run_dir import RunDirError


class CsvLog:
    FIELDS = ["step", "epoch", "loss", "val_loss", "val_ppl", "lr", "tokens_per_s", "tflops", "bubble", "grad_norm",
              "noise_scale", "batch_size", "peak_mem_mib", "skipped", "elapsed_s", "target_tokens", "padding_tokens"]

    def __init__(self, path: str, resume_step: int | None = None) -> None:
        """A new log, or (``resume_step``: the step the run resumes after) the existing file kept up
        to that step under its own header, so rows the interrupted run logged after its checkpoint
        (and a torn last row) are dropped before this run logs those steps again.

        A write that fails (a full disk) raises nothing: it sets :attr:`error` (one line naming the
        log and the fix) and later rows are dropped; the loop ends every rank on it after the step."""
        self.path = path
        self.fields = self.FIELDS
        self.error: RunDirError | None = None
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            if resume_step is not None and os.path.exists(path) and os.path.getsize(path) > 0:
                self._truncate(resume_step)
                self.f = open(path, "a", newline="")
                self.w = csv.DictWriter(self.f, fieldnames=self.fields)
            else:
                self.f = open(path, "w", newline="")
                self.w = csv.DictWriter(self.f, fieldnames=self.fields)
                self.w.writeheader()
                self.f.flush()
        except OSError as e:
            self._fail(e)

    def _truncate(self, resume_step: int) -> None:
        with open(self.path, newline="") as f:
            rows = list(csv.reader(f))
        self.fields = rows[0]
        kept = [r for r in rows[1:] if len(r) == len(self.fields) and r[0].isdigit() and int(r[0]) <= resume_step]
        out = io.StringIO()
        csv.writer(out, lineterminator="\r\n").writerows([self.fields, *kept])  # DictWriter's own line ends
        write_text_atomic(self.path, out.getvalue())

    def _fail(self, e: OSError) -> None:
        self.error = RunDirError(f"{self.path}: cannot write the training log ({e.strerror}); free space or fix "
                                 "the permissions, then continue with --resume")

    def row(self, **kw: Any) -> None:
        if self.error is not None:
            return
        try:
            self.w.writerow({k: kw.get(k, "") for k in self.fields})
            self.f.flush()
        except OSError as e:
            self._fail(e)
