"""Optimise the initial noise through the whole sampler: gradient descent with optax on a loss of the image.

The loss asks for a target colour in the image's left half and keeps the right half as the unoptimised sample
drew it. Every step differentiates through the text encoder, the guided scan loop (each step rematerialised)
and the VAE decoder, in one compiled program; the loss falls as it runs.

    python scripts/optimize_latents.py                                   # weights/tiny-sd, offline, ~1 min on a CPU
    python scripts/optimize_latents.py --model stable-diffusion-v1-5/stable-diffusion-v1-5 --steps 20 --size 512
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

from sdflax import StableDiffusion
from sdflax.pipeline import checks

REPO = Path(__file__).resolve().parents[1]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(REPO / "weights" / "tiny-sd"))
    parser.add_argument("--prompt", default="a photo of a lighthouse at dusk")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps per image")
    parser.add_argument("--size", type=int, default=None, help="image side in pixels (default: the model's)")
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--learning-rate", type=float, default=0.05)
    parser.add_argument("--target", type=float, nargs=3, default=(0.9, 0.3, 0.1), help="RGB in [0, 1]")
    args = parser.parse_args(argv)

    pipe, params = StableDiffusion.from_pretrained(args.model, scheduler="ddim")
    ids = pipe.prepare_inputs([args.prompt])
    key = jax.random.key(0)
    height, width = checks.sizes(pipe.spec, args.size, args.size)
    shape = (1, pipe.unet.config.in_channels, height // pipe.vae_scale_factor, width // pipe.vae_scale_factor)
    start = jax.random.normal(key, shape)
    target = jnp.asarray(args.target)

    def images_of(latents):
        return pipe._generate(ids, params, key, args.steps, height, width, latents=latents)

    reference = images_of(start)
    half = width // 2

    def loss_fn(latents):
        images = images_of(latents)
        colour = jnp.mean(jnp.square(images[:, :, :half] - target))
        keep = jnp.mean(jnp.square(images[:, :, half:] - reference[:, :, half:]))
        prior = 1e-3 * jnp.mean(jnp.square(latents))  # stay near the Gaussian shell noise lives on
        return colour + keep + prior

    optimizer = optax.adam(args.learning_rate)

    @jax.jit
    def update(latents, opt_state):
        loss, grad = jax.value_and_grad(loss_fn)(latents)
        updates, opt_state = optimizer.update(grad, opt_state)
        return optax.apply_updates(latents, updates), opt_state, loss

    latents, opt_state = start, optimizer.init(start)
    t0 = time.perf_counter()
    for i in range(args.iterations):
        latents, opt_state, loss = update(latents, opt_state)
        print(f"iteration {i:3d}  loss {float(loss):.6f}  ({time.perf_counter() - t0:.1f} s)", flush=True)
    print(f"final loss {float(loss_fn(latents)):.6f}")


if __name__ == "__main__":
    main()
