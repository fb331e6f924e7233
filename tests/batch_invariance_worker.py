"""Run by test_batch_invariance.py in a subprocess with simulated CPU devices: four images, one key each, made
alone, as one batch, under pmap (jit=True) and under generate_sharded, saved for the test to compare."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from sdflax import StableDiffusion, enable_compile_cache, replicate, shard

enable_compile_cache()  # the test session's folder (SDFLAX_CACHE_DIR): workers share their compiled programs

REPO = Path(__file__).resolve().parent.parent
PROMPTS = ["a fox", "a lighthouse at night", "a tree", "a red car"]


def main(out):
    pipe, params = StableDiffusion.from_pretrained(REPO / "weights" / "tiny-sd", scheduler="euler_ancestral")
    ids = pipe.prepare_inputs(PROMPTS)
    keys = jnp.stack([jax.random.key(seed) for seed in range(len(PROMPTS))])
    steps = 3
    results = {
        "batch": pipe(ids, params, keys, steps).images,
        "pmap": pipe(shard(ids), replicate(params), shard(keys), steps, jit=True).images.reshape(len(PROMPTS), -1),
        "sharded": pipe.generate_sharded(ids, params, keys, steps),
    }
    if jax.local_device_count() == 2:
        results["alone"] = np.concatenate([pipe(ids[b:b + 1], params, keys[b:b + 1], steps).images
                                           for b in range(len(PROMPTS))])
    np.savez(out, **{name: np.asarray(x).reshape(len(PROMPTS), -1) for name, x in results.items()})


if __name__ == "__main__":
    main(sys.argv[1])
