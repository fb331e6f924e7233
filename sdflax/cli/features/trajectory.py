"""--trajectory OUT.webp and --trajectory-sheet OUT.png: the sampler's x̂₀ prediction at every model evaluation
(`return_trajectory=True`'s `pred_x0`), decoded by the VAE, of the first image: an animated, lossless WebP, and the
evaluations side by side with the σ each was made at written under it."""

from __future__ import annotations

import os

import numpy as np

from ..request import UserError

FLAG = "--trajectory"
FRAME_MS = 250  # each evaluation shown a quarter of a second


def add_flags(add, command):
    if command == "batch":
        return
    add("--trajectory", metavar="OUT.webp", help="also write the first image's x̂₀ prediction at every model "
        "evaluation, decoded, as an animated lossless WebP")
    add("--trajectory-sheet", metavar="OUT.png", help="also write those predictions side by side, each with the "
        "noise level σ it was made at written under it")


def used(request) -> bool:
    return request.trajectory is not None or request.trajectory_sheet is not None


def check_flags(request, batch):
    for flag, path, suffix in (("--trajectory", request.trajectory, ".webp"),
                               ("--trajectory-sheet", request.trajectory_sheet, ".png")):
        if path is not None:
            check_new_file(flag, path, suffix)
    if used(request) and request.refiner is not None:
        raise UserError("--trajectory with --refiner is not supported: the refiner's steps are another program; "
                        "drop one of them")


def check_new_file(flag, path, suffix):
    """`path` ends in `suffix`, is not there yet (sdflax never overwrites a file) and its folder is."""
    if not path.lower().endswith(suffix):
        raise UserError(f"{flag} {path}: give a file name ending in {suffix}")
    if os.path.lexists(path):
        raise UserError(f"{flag} {path} exists: sdflax never overwrites a file; choose another name")
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        raise UserError(f"{flag} {path}: the folder {folder} does not exist: make it, or choose another name")


def call_arguments(pipeline, value, rows):
    return [], {"return_trajectory": True}


def write(request, made):
    """The first image's decoded x̂₀ at each evaluation, as the WebP and the sheet asked for."""
    frames = decoded_frames(made.pipeline, made.params, made.trajectory.pred_x0[:, 0])
    from PIL import Image

    pictures = [Image.fromarray(frame) for frame in frames]
    if request.trajectory is not None:
        with open_new(request.trajectory) as file:
            pictures[0].save(file, format="WEBP", save_all=True, append_images=pictures[1:], lossless=True,
                             duration=FRAME_MS, loop=0)
        print(request.trajectory)
    if request.trajectory_sheet is not None:
        from ..sheets import labelled_strip

        sigmas = evaluation_sigmas(made.pipeline.scheduler, made.checkpoint.steps, len(frames))
        with open_new(request.trajectory_sheet) as file:
            labelled_strip(pictures, [f"sigma {s:.3g}" for s in sigmas]).save(file, format="PNG")
        print(request.trajectory_sheet)


def decoded_frames(pipeline, params, pred_x0):
    """(evals, 4, h, w) latents -> (evals, H, W, 3) uint8, decoded in one call (one program per shape)."""
    import jax

    images = np.asarray(jax.jit(pipeline.decode_latents)(params, np.asarray(pred_x0)))
    return (images * 255).round().astype(np.uint8)


def evaluation_sigmas(scheduler, steps, evals) -> np.ndarray:
    """The noise level σ of each of the last `evals` evaluations of the schedule (img2img runs only those): for the
    DDPM-trained schedules σ_t = √((1-ᾱ_t)/ᾱ_t) at the evaluation's timestep t, log σ interpolated between integer
    t (k-diffusion's `t_to_sigma`); for flow matching σ = t / num_train_timesteps."""
    from ...schedulers.common import ScheduleConfig, train_sigmas

    timesteps = np.asarray(scheduler.set_timesteps(steps, shape=(1, 4, 8, 8)).timesteps, np.float64)[-evals:]
    config = scheduler.config
    if not isinstance(config, ScheduleConfig):
        return timesteps / config.num_train_timesteps
    train = train_sigmas(config, zero_snr=getattr(config, "rescale_betas_zero_snr", False)).astype(np.float64)
    return np.exp(np.interp(timesteps, np.arange(len(train)), np.log(train)))


def open_new(path):
    """`path` opened for writing only if nothing is there (made since the check before loading: refused)."""
    try:
        return open(path, "xb")
    except FileExistsError:
        raise UserError(f"{path} exists now: sdflax never overwrites a file; choose another name") from None
