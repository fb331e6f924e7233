"""`sdflax train`'s caches on disk, in OUT/cache or --latent-cache (which runs may share): each picture's VAE
posterior (--cache-latents) and, where the text encoders are frozen, each caption's encoder states
(--cache-text-encoder-outputs), encoded once. Over several processes each encodes its share first, then reads the
rest (or encodes it too, where the folder is not one they all see)."""

from __future__ import annotations

import os

import numpy as np


def identity(trees, dtype) -> str:
    """A digest of weights (every array of the pytrees, by path) and the dtype they compute in."""
    import hashlib

    import jax

    digest = hashlib.sha256(np.dtype(dtype).name.encode())
    for tree in trees:
        for path, leaf in sorted(jax.tree_util.tree_flatten_with_path(tree)[0],
                                 key=lambda item: jax.tree_util.keystr(item[0])):
            digest.update(jax.tree_util.keystr(path).encode() + np.asarray(leaf).tobytes())
    return digest.hexdigest()


def folder(run) -> str:
    s = run.settings
    return os.path.expanduser(s["latent_cache"]) if s["latent_cache"] else os.path.join(run.out, "cache")


def in_shares(run, jobs, fill) -> tuple[int, int]:
    """(encoded, read): `fill(job)` (True where it encoded) over this process's share of the jobs, then, once
    every process has done its share, over the rest."""
    p, n = run.process, run.processes
    done = [fill(job) for job in jobs[p::n]]
    if n > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("sdflax train: caches")
    done += [fill(job) for i, job in enumerate(jobs) if i % n != p]
    return sum(done), len(done) - sum(done)


def fill_latents(run):
    """run.cache and run.cached ((stream, index, flip, size) -> key): each picture's (and flipped, with
    --random-flip) posterior at its training size (a class picture's: at each size of the data's pictures), from the
    cache or encoded into it (at the centre crop: the cache holds one crop a picture and size)."""
    from ..train.data import LatentCache, file_digest, load_row

    trainer = run.trainer
    run.cache, run.cached = LatentCache(folder(run), identity([trainer.base_params["vae"]], trainer.compute_dtype)), {}
    flips = (False, True)[:2 if run.settings["random_flip"] else 1]
    jobs = [(0, index, flip, size) for index, size in enumerate(run.sizes) for flip in flips]
    jobs += [(1, index, flip, size) for index in range(len(run.class_pictures)) for flip in flips
             for size in sorted(set(run.sizes))]
    digests = {}

    def fill(job):
        stream, index, flip, size = job
        picture = run.pictures(stream)[0][index]
        if picture.path not in digests:
            digests[picture.path] = file_digest(picture.path)
        key = run.cached[job] = run.cache.key(digests[picture.path], size, flip)
        if run.cache.read(key) is not None:
            return False
        pixels, original, corner = load_row(picture.path, size, flip)
        mean, std = run.encode(pixels[None])
        run.cache.write(key, mean[0], std[0], original, corner)
        return True

    encoded, read = in_shares(run, jobs, fill)
    run.status(f"train: latents of {encoded + read} pictures: {encoded} encoded, {read} read from {run.cache.folder}")


def fill_states(run):
    """run.states and run.state_keys (caption -> key): the frozen text encoders' states of every caption (and of
    the empty one, with --caption-dropout), from the cache or encoded into it."""
    from ..train.data import StateCache

    trainer, s = run.trainer, run.settings
    encoders = [trainer.base_params[name] for name in trainer.encoders]
    run.states, run.state_keys = StateCache(folder(run), identity(encoders, trainer.compute_dtype)), {}
    captions = {p.caption for p in (*run.plan.pictures, *run.class_pictures)} | ({""} if s["caption_dropout"] else set())

    def fill(caption):
        ids = np.asarray(trainer.pipeline.prepare_inputs([caption]))
        key = run.state_keys[caption] = run.states.key(caption, ids)
        if run.states.read(key) is not None:
            return False
        run.states.write_entry(key, run.encode_text(ids))
        return True

    encoded, read = in_shares(run, sorted(captions), fill)
    run.status(f"train: text encoder states of {encoded + read} captions: {encoded} encoded, {read} read from "
               f"{run.states.folder}")


def encoders_frozen(settings) -> bool:
    return settings["method"] != "textual-inversion" and not settings["train_text_encoder"]
