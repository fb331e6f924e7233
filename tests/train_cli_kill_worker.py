"""`python train_cli_kill_worker.py UPDATE ARGS...`: `sdflax ARGS` in a process that kills itself with SIGKILL as
update UPDATE begins (kill -9 at a known point: after the checkpoints before it, with nothing of it saved)."""

import os
import signal
import sys

from sdflax.__main__ import main
from sdflax.train import Trainer

UPDATE = int(sys.argv[1])
step = Trainer.step


def killed_at_update(self, batch, *args, **kwargs):
    if int(self.state.step) + 1 == UPDATE:
        os.kill(os.getpid(), signal.SIGKILL)
    return step(self, batch, *args, **kwargs)


Trainer.step = killed_at_update

if __name__ == "__main__":
    sys.exit(main(sys.argv[2:]))
