"""One of two processes training together through jax.distributed on this machine's CPU (two devices each):
`python train_multihost_worker.py PORT PROCESS MODEL DATA.npz CHECKPOINT`. Each process passes its half of every
update's rows; the first writes the checkpoint after the last update."""

import os
import sys

import numpy as np

import jax

MULTIHOST_CONFIG = dict(method="full", learning_rate=1e-3, noise_offset=0.1)


def main(port, process, model, data, checkpoint):
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", 2, int(process))
    from jax.sharding import Mesh

    from sdflax import StableDiffusion
    from sdflax.train import TrainConfig, Trainer

    pipe, params = StableDiffusion.from_pretrained(model)
    trainer = Trainer(pipe, params, TrainConfig(**MULTIHOST_CONFIG), mesh=Mesh(np.array(jax.devices()), ("data",)))
    arrays = np.load(data)
    updates = len({name.split(".")[0] for name in arrays.files})
    for i in range(updates):
        mine = {name.split(".", 1)[1]: np.array_split(arrays[name], 2)[int(process)] for name in arrays.files
                if name.startswith(f"{i}.")}
        draws = {name: mine.pop(name) for name in ("noise", "timesteps", "offset_noise")}
        trainer.step(mine, **draws)
    trainer.save_checkpoint(checkpoint)


if __name__ == "__main__":
    # Set here, not on import: test_train imports MULTIHOST_CONFIG, and an XLA_FLAGS changed in the pytest worker
    # would be every later subprocess's (compiled with other options, their numbers no longer the worker's).
    from compile_flags import xla_flags

    os.environ["XLA_FLAGS"] = xla_flags(2)  # before JAX's backend starts (on the first use below)
    main(*sys.argv[1:])
