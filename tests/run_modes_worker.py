"""Runs every pipeline in every mode on 2 simulated CPU devices and saves what test_run_modes.py compares.

Usage: XLA_FLAGS=--xla_force_host_platform_device_count=2 python run_modes_worker.py FOLDER
FOLDER holds the diffusers checkpoints `sd` and `xl`; results go to FOLDER/results.npz and FOLDER/results.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

import jax

from sdflax import (StableDiffusion, StableDiffusionImg2Img, StableDiffusionInpaint, StableDiffusionXL,
                    enable_compile_cache, replicate, shard)

enable_compile_cache()  # the test session's folder (SDFLAX_CACHE_DIR): workers share their compiled programs

STEPS, STRENGTH, BATCH = 3, 0.75, 2
PROMPTS = ["a red boat on a lake", "a city street at night"]
NEGATIVE = ["blurry", "dark"]


def custom_guidance(uncond, cond, scale):
    """Not classifier-free guidance: the conditional prediction pushed away from the unconditional by scale / 2."""
    return cond + 0.5 * scale * (cond - uncond)


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, step, num_steps, latents):
        self.calls.append((step, num_steps, np.asarray(latents).shape))


def compiles_during(fn):
    """(fn's result, the number of XLA compiles it caused)."""
    events = []
    def listener(name, *_, **__):
        if name == "/jax/core/compile/backend_compile_duration":
            events.append(name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        out = fn()
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    return out, len(events)


def main(folder: Path):
    assert jax.local_device_count() == 2
    rng = np.random.default_rng(0)
    kinds = {"sd": (StableDiffusion, "sd"), "img2img": (StableDiffusionImg2Img, "sd"),
             "inpaint": (StableDiffusionInpaint, "sd"), "xl": (StableDiffusionXL, "xl")}
    arrays, report = {}, {}
    for kind, (cls, checkpoint) in kinds.items():
        pipe, params = cls.from_pretrained(folder / checkpoint)
        ids, neg = pipe.prepare_inputs(PROMPTS), pipe.prepare_inputs(NEGATIVE)
        side = pipe.unet.config.sample_size * pipe.vae_scale_factor
        latent = (BATCH, pipe.vae.config.latent_channels, side // pipe.vae_scale_factor, side // pipe.vae_scale_factor)
        noise = rng.standard_normal(latent, dtype=np.float32)
        images = {"image": rng.uniform(-1, 1, (BATCH, 3, side, side)).astype(np.float32),
                  "mask": (rng.uniform(size=(BATCH, 1, side, side)) > 0.5).astype(np.float32)}
        images = {name: images[name] for name, _ in cls.start.images}
        embeds = pipe.encode_prompt(params, ids), pipe.encode_prompt(params, neg)
        if kind == "xl":
            embeds = {"prompt_embeds": embeds[0][0], "pooled_prompt_embeds": embeds[0][1],
                      "neg_prompt_embeds": embeds[1][0], "neg_pooled_prompt_embeds": embeds[1][1]}
        else:
            embeds = {"prompt_embeds": embeds[0], "neg_prompt_embeds": embeds[1]}
        keys = jax.random.split(jax.random.key(3), BATCH)  # one key per image: the same draws in every mode
        other_keys = jax.random.split(jax.random.key(4), BATCH)
        start = {"strength": STRENGTH} if images else {}
        given_noise = {"noise" if images else "latents": noise}
        settings = {
            # diffusers' rescaled CFG, given start noise, negative prompt ids, a trajectory
            "rescale": dict(ids=ids, extra=dict(neg_prompt_ids=neg, guidance_rescale=0.5, return_trajectory=True,
                                                **given_noise)),
            # a custom guidance function, text embeddings instead of ids, a host callback, noise from the keys
            "custom": dict(ids=None, extra=dict(guidance=custom_guidance, **embeds)),
        }
        for name, setting in settings.items():
            for mode in ("call", "pmap", "sharded"):
                recorder = Recorder()
                extra = dict(setting["extra"], **({"callback": recorder} if name == "custom" else {}))
                batched = {k: v for k, v in extra.items() if k not in ("guidance_rescale", "guidance", "callback",
                                                                       "return_trajectory")}
                shared = {k: v for k, v in extra.items() if k not in batched}

                def run(keys, scale):
                    if mode == "call":
                        return pipe(setting["ids"], *images.values(), params, keys, num_inference_steps=STEPS,
                                    guidance_scale=scale, **start, **batched, **shared)
                    if mode == "pmap":
                        placed = {k: shard(v) for k, v in batched.items()}
                        ids = None if setting["ids"] is None else shard(setting["ids"])
                        return pipe(ids, *map(shard, images.values()), replicate(params), shard(keys),
                                    num_inference_steps=STEPS, guidance_scale=scale, jit=True, **start, **placed,
                                    **shared)
                    return pipe.generate_sharded(setting["ids"], *images.values(), params, keys,
                                                 num_inference_steps=STEPS, guidance_scale=scale, **start, **batched,
                                                 **shared)

                out, _ = compiles_during(lambda: run(keys, 6.0))
                calls_first = len(recorder.calls)
                _, recompiles = compiles_during(lambda: run(other_keys, 3.0))  # other traced values
                if mode == "sharded":
                    out_images, trajectory = out if name == "rescale" else (out, None)
                else:
                    out_images, trajectory = out.images, out.trajectory
                prefix = f"{kind}/{name}/{mode}"
                arrays[f"{prefix}/images"] = np.asarray(out_images)
                if trajectory is not None:
                    arrays[f"{prefix}/latents"] = np.asarray(trajectory.latents)
                    arrays[f"{prefix}/pred_x0"] = np.asarray(trajectory.pred_x0)
                report[prefix] = {"recompiles": recompiles, "callback_calls": calls_first,
                                  "callback_steps": sorted({c[0] for c in recorder.calls}),
                                  "callback_shapes": sorted({c[2] for c in recorder.calls})}
        report[f"{kind}/jit_programs"] = pipe._jitted._cache_size()
    np.savez(folder / "results.npz", **arrays)
    (folder / "results.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
