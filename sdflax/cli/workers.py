"""`sdflax batch`'s two threads: a producer that makes the plan's batches on the devices and a writer that turns
them into PNGs and manifest records meanwhile; signals stop them after the image in hand."""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time

from .manifest import link_png, record
from .output import png_info
from .request import UserError, input_errors


class Writer:
    """A thread that turns finished batches into PNGs and manifest records while the devices make the next one;
    after a signal it finishes the image in hand and stops."""

    def __init__(self, folder, manifest, process, total, status, settings, base, to_pil, stop):
        self.folder, self.manifest, self.process, self.total, self.status = folder, manifest, process, total, status
        self.settings, self.base, self.to_pil = settings, base, to_pil
        self.jobs = queue.Queue(maxsize=1)  # one batch waiting while the next is made
        self.stop, self.error, self.written = stop, None, 0
        self.first = None  # (time, count) when the first batch was written: the rate leaves compiling out
        self.thread = threading.Thread(target=self.loop, name="sdflax-batch-writer", daemon=True)

    def loop(self):
        try:
            while not self.stop.is_set():
                try:
                    job = self.jobs.get(timeout=0.1)
                except queue.Empty:
                    continue
                if job is None:
                    return
                self.write(*job)
        except BaseException as e:  # noqa: BLE001 (handed to the main thread)
            self.error = e
            self.stop.set()

    def write(self, lines, images):
        if not lines:  # a batch of other processes' rows only
            return
        for line, image in zip(lines, self.to_pil(images)):
            if self.stop.is_set():
                return
            settings = self.settings(line)
            try:
                link_png(self.folder, line.name, image, png_info(settings), self.process)
                self.manifest.append(record(line, self.base, settings, self.process, time.time()))
            except FileExistsError as e:
                raise UserError(f"{line.name} exists now in {self.folder}: sdflax never overwrites a file; move "
                                "it and run the command again") from e
            except OSError as e:  # a full disk: what was written is whole, and the next run goes on from there
                raise UserError(f"cannot write {line.name} in {self.folder} ({e.strerror or e}) after "
                                f"{self.written} of {self.total} images: make room and run the same command again "
                                "to make the rest") from e
            self.written += 1
        self.progress()

    def progress(self):
        now = time.perf_counter()
        if self.first is None:
            self.first = (now, self.written)
            rate = ""
        else:
            per_s = (self.written - self.first[1]) / max(now - self.first[0], 1e-9)
            left = (self.total - self.written) / per_s if per_s else 0
            rate = f", {per_s:.2f} images/s, ETA {int(left // 3600)}:{int(left % 3600 // 60):02d}:{int(left % 60):02d}"
        self.status(f"batch: {self.written}/{self.total} images{rate}")


class Producer:
    """A thread that runs the plan's batches (`make(key, lines)` -> this process's images of the rows in `mine`)
    and hands this process's rows to the writer."""

    def __init__(self, make, plan, mine, writer):
        self.make, self.plan, self.mine, self.writer = make, plan, mine, writer
        self.error = None
        self.thread = threading.Thread(target=self.loop, name="sdflax-batch-producer", daemon=True)

    def loop(self):
        try:
            for key, lines in self.plan:
                if self.writer.stop.is_set():
                    return
                images = self.make(key, lines)
                own = [(lines[row], image) for row, image in zip(self.mine, images) if row < len(lines)]
                job = ([line for line, _ in own], [image for _, image in own])
                while not self.writer.stop.is_set():
                    try:
                        self.writer.jobs.put(job, timeout=0.1)
                        break
                    except queue.Full:
                        continue
            self.writer.jobs.put(None)
        except BaseException as e:  # noqa: BLE001 (handed to the main thread)
            self.error = e
            self.writer.stop.set()


def exit_now(code):
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class Signals:
    """While a batch runs, SIGINT and SIGTERM set `stop` rather than end the process, so that no image is left
    half-written; a second signal ends it at once (the files are whole either way)."""

    def __enter__(self):
        self.stop, self.received = threading.Event(), []
        self.previous = {s: signal.signal(s, self.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def on_signal(self, signum, frame):
        self.received.append(signum)
        self.stop.set()
        for s in self.previous:
            signal.signal(s, signal.SIG_DFL)

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def run_until_done_or_signal(producer, writer, signals, out, processes) -> int:
    """Run both threads until the writer is done, or a signal has stopped it after the image in hand (exit 130 for
    SIGINT, 143 for SIGTERM). The main thread only waits, so a signal is seen at once even while a device
    computes (that batch is dropped, and made by the next run)."""
    writer.thread.start()
    producer.thread.start()
    while writer.thread.is_alive():
        writer.thread.join(0.2)
    for error in (producer.error, writer.error):
        if error is None:
            continue
        if processes == 1:
            raise error
        # The other processes wait for this one's part of the next batch, and jax.distributed's shutdown would
        # wait for them: end now, and the coordination service stops them.
        if isinstance(error, (UserError, *input_errors())):
            print(f"sdflax: error: {' '.join(str(error).split())}", file=sys.stderr)
        else:
            import traceback

            traceback.print_exception(error)
        exit_now(2 if isinstance(error, UserError) else 1)
    if signals.received:
        name = signal.Signals(signals.received[0]).name
        print(f"sdflax: stopped by {name} after {writer.written} of {writer.total} images; the manifest in {out} "
              "lists every image written: run the same command again to make the rest", file=sys.stderr)
        exit_now(128 + signals.received[0])  # a device may still be computing the dropped batch: do not wait
    producer.thread.join()
    print(f"batch: {writer.written} images written to {out}", file=sys.stderr)
    return 0
