"""A fresh process that restores a training checkpoint and makes one more update: `python train_resume_worker.py
MODEL CHECKPOINT BATCH.npz OUT.npz` (the trainer as test_train.py's resume test makes it)."""

import sys

import numpy as np

import jax
from flax import traverse_util

from sdflax import StableDiffusion
from sdflax.train import TrainConfig, Trainer

RESUME_CONFIG = dict(method="lora", learning_rate=1e-3, rank=2, noise_offset=0.05, gradient_accumulation_steps=2,
                     use_ema=True)


def main(model, checkpoint, batch, out):
    pipe, params = StableDiffusion.from_pretrained(model)
    trainer = Trainer(pipe, params, TrainConfig(**RESUME_CONFIG), seed=11)
    trainer.restore_checkpoint(checkpoint)
    trainer.step(dict(np.load(batch)))
    flat = traverse_util.flatten_dict(jax.device_get(trainer.state.trainable), sep="|")
    np.savez(out, **flat)


if __name__ == "__main__":
    main(*sys.argv[1:])
