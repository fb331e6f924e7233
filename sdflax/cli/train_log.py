"""What `sdflax train` reports as it goes: log.jsonl (one record an update), loss.png, and with --report-to
tensorboard the same scalars and the validation images as TensorBoard events in OUT/logs (tensorboardX)."""

from __future__ import annotations

import io
import json
import os
import time

import numpy as np

SMOOTHING = 0.9  # loss.png's and log.jsonl's smoothed loss: an exponential moving average, debiased
TENSORBOARD = "logs"  # in --out, as diffusers' scripts' --logging_dir
SCALARS = ("loss", "smoothed", "learning_rate")


def check_report_to(report_to):
    """Before anything is written: the package --report-to needs is installed (no JAX here)."""
    import importlib.util

    from .request import UserError

    if report_to == "tensorboard" and importlib.util.find_spec("tensorboardX") is None:
        raise UserError("--report-to tensorboard needs tensorboardX: pip install tensorboardX (or drop --report-to)")


class TrainLog:
    """log.jsonl: one record an update ({"step", "loss", "smoothed", "learning_rate", "time"}); on a resumed run the
    records past its checkpoint (lost updates, made again) are dropped first. `path` None: kept in memory only (the
    processes but the first). `tensorboard`: a folder for the TensorBoard events of the same records and the
    validation images, its events past the checkpoint dropped by TensorBoard (purge_step)."""

    def __init__(self, path, start, tensorboard=None):
        from ..train.files import atomic_write

        self.path, self.records, self.file, self.writer = path, [], None, None
        if path is None:
            return
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                lines = f.read().split("\n")
            for line in lines:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a line a kill cut short
                if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= start:
                    self.records.append(record)
            atomic_write(path, [b"".join(json.dumps(r).encode() + b"\n" for r in self.records)])
        self.file = open(path, "a", encoding="utf-8")
        if tensorboard:
            from tensorboardX import SummaryWriter

            self.writer = SummaryWriter(tensorboard, purge_step=start + 1 if start else None)

    def add(self, step, loss, learning_rate):
        n = len(self.records) + 1
        last = self.records[-1]["smoothed"] * (1 - SMOOTHING ** (n - 1)) if self.records else 0.0
        average = SMOOTHING * last + (1 - SMOOTHING) * loss
        record = {"step": step, "loss": loss, "smoothed": average / (1 - SMOOTHING ** n),
                  "learning_rate": learning_rate, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
        self.records.append(record)
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.writer is not None:
            for name in SCALARS:
                self.writer.add_scalar(f"train/{name}", record[name], step)

    def add_image(self, step, image):
        """A validation's row of images (a PIL image, as samples/step-N.png holds it)."""
        if self.writer is not None:
            self.writer.add_image("validation", np.asarray(image.convert("RGB")), step, dataformats="HWC")
            self.writer.flush()

    def sync(self):
        if self.file is not None:
            os.fsync(self.file.fileno())
        if self.writer is not None:
            self.writer.flush()

    def close(self):
        if self.writer is not None:
            self.writer.close()

    def plot(self, path):
        from ..train.plots import loss_plot

        if self.file is not None:
            write_png(path, loss_plot([r["step"] for r in self.records], [r["loss"] for r in self.records],
                                      [r["smoothed"] for r in self.records]))


def write_png(path, image):
    from ..train.files import atomic_write

    data = io.BytesIO()
    image.save(data, format="PNG")
    atomic_write(path, [data.getvalue()])
