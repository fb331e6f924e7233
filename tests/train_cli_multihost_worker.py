"""One of several processes of `sdflax train` joined by --coordinator on this machine's CPU (one device each):
`python train_cli_multihost_worker.py READS.txt TRAIN-ARGS...`. Every picture the data reader loads is appended to
READS.txt, so that the test sees which rows each process read."""

import sys

import jax


def main(reads, *args):
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    import sdflax.train.data
    from sdflax.__main__ import main as run_sdflax

    load_row = sdflax.train.data.load_row

    def logged(path, *rest, **kwargs):
        with open(reads, "a") as f:
            f.write(path + "\n")
        return load_row(path, *rest, **kwargs)

    sdflax.train.data.load_row = logged
    return run_sdflax(list(args))


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
