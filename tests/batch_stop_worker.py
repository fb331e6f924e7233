"""`python batch_stop_worker.py kill|wait|load N ARGS...`: `sdflax ARGS` (a batch run) stopped at a known point,
however slow or busy the machine: `kill` ends the process with SIGKILL once image N's PNG is in place, before its
manifest record; `wait` has the writer, once it has listed N images, wait for the signal that stops the run (the
test's), so that the signal comes mid-run, never after the last batch; `load` has the run, once its models are
loaded, wait for that signal before it makes any image (N unused)."""

import os
import signal
import sys
import threading

from sdflax.__main__ import main
from sdflax.cli import batch, workers

HOW, IMAGE = sys.argv[1], int(sys.argv[2])
link_png, write = workers.link_png, workers.Writer.write
linked = []


def link_then_kill(*args, **kwargs):
    link_png(*args, **kwargs)
    linked.append(args[1])
    if len(linked) == IMAGE:
        os.kill(os.getpid(), signal.SIGKILL)


def write_then_wait(self, lines, images):
    write(self, lines, images)
    if self.written >= IMAGE:
        self.stop.wait(600)  # set by the test's signal; the timeout only guards against a hang


signalled, on_signal, load = threading.Event(), workers.Signals.on_signal, batch.load


def on_signal_seen(self, signum, frame):
    on_signal(self, signum, frame)
    signalled.set()


def load_then_wait(*args, **kwargs):
    loaded = load(*args, **kwargs)
    signalled.wait(600)  # set by the test's signal; the timeout only guards against a hang
    return loaded


if HOW == "kill":
    workers.link_png = link_then_kill
elif HOW == "wait":
    workers.Writer.write = write_then_wait
else:
    workers.Signals.on_signal, batch.load = on_signal_seen, load_then_wait

if __name__ == "__main__":
    sys.exit(main(sys.argv[3:]))
