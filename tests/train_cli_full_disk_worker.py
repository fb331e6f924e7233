"""`sdflax train` with its updates recorded, not made (no compile):
`python train_cli_full_disk_worker.py [--fsize-after-first-save BYTES] TRAIN-ARGS...`. With --fsize-after-first-save,
once the first checkpoint is saved the process may write no file larger than BYTES (RLIMIT_FSIZE, SIGXFSZ ignored:
a write past it fails with EFBIG): the fallback where no small filesystem can be mounted."""

import resource
import signal
import sys


def main(*args):
    from sdflax.cli.train_run import Run
    from sdflax.train import Trainer

    Trainer.step = lambda self, batch, *rest, **kwargs: {"loss": 1.0, "learning_rate": 1e-4}
    if args[0] == "--fsize-after-first-save":
        limit, args, save = int(args[1]), args[2:], Run.save

        def limited(self, step):
            save(self, step)
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

        Run.save = limited
    from sdflax.__main__ import main as run_sdflax

    return run_sdflax(list(args))


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
