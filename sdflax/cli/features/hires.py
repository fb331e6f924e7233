"""--hires SCALE, --hires-strength S, --hires-steps N (generate): A1111's hires fix with its default "Latent"
upscaler. The picture is made at the size asked, its latents are upscaled SCALE times (bilinear, as A1111's
`interpolate(mode="bilinear")`; the latents, not the decoded picture), and image-to-image redraws them at strength
S: two library calls, `output_type="latent"` then the family's img2img pipeline with the upscaled latents as its
image."""

from __future__ import annotations

from ..parse import number, positive_int
from ..request import UserError

FLAG = "--hires"
DENOISERS = ("unet",)
DEFAULT_STRENGTH = 0.7  # A1111's denoising strength of the hires pass

scale = number(lambda v: 1 <= v <= 8, "must be in [1, 8], got {text}: how many times larger the picture is drawn "
               "again (e.g. 2)")
fraction = number(lambda v: 0 < v <= 1, "must be in (0, 1], got {text}: how far the upscaled picture is noised "
                  "before it is redrawn (e.g. 0.7)")


def add_flags(add, command):
    if command != "generate":
        return
    add("--hires", type=scale, metavar="SCALE", help="A1111's hires fix: upscale the picture's latents SCALE times "
        "(bilinear, A1111's Latent upscaler) and redraw them by image-to-image; --height and --width are the first "
        "pass's size")
    add("--hires-strength", type=fraction, metavar="S", help=f"with --hires: the redraw's strength, in (0, 1] "
        f"(default: {DEFAULT_STRENGTH}, A1111's)")
    add("--hires-steps", type=positive_int, metavar="N", help="with --hires: the redraw's steps, of which it runs "
        "int(N * S) (default: --steps)")


def used(request) -> bool:
    return request.hires is not None


def check_flags(request, batch):
    for flag, value in (("--hires-strength", request.hires_strength), ("--hires-steps", request.hires_steps)):
        if value is not None and request.hires is None:
            raise UserError(f"{flag} applies with --hires: add --hires SCALE, or drop {flag}")
    if request.hires is None:
        return
    for flag, given in (("--refiner", request.refiner), ("--controlnet", request.controlnet),
                        ("--t2i-adapter", request.t2i_adapter), ("--ip-adapter", request.ip_adapter)):
        if given:
            raise UserError(f"--hires with {flag} is not supported: drop one of them")


def resolve(request, configs, pictures) -> tuple:
    """(height, width, strength, steps) of the second pass: the first pass's size times --hires, down to a multiple
    of the VAE scale factor; the redraw runs a step."""
    from ...pipeline.starts import start_step

    step = configs.vae.scale_factor
    height, width = (int(side * request.hires) // step * step for side in (configs.height, configs.width))
    strength = request.hires_strength if request.hires_strength is not None else DEFAULT_STRENGTH
    steps = request.hires_steps or configs.steps
    try:
        start_step(steps, strength)
    except ValueError:
        raise UserError(f"--hires-strength {strength} with {steps} steps runs no step: raise --hires-strength or "
                        "--hires-steps") from None
    return height, width, strength, steps


def next_stage(request, checkpoint, dtype):
    """None: the second pass runs the base's own models."""
    return None


def upscaled_latents(latents, height, width):
    """Latents (B, C, h, w) -> (B, C, height, width), bilinear with half-pixel centres (torch's align_corners=False)."""
    import jax
    import numpy as np

    return np.asarray(jax.image.resize(latents, (*latents.shape[:2], height, width), "bilinear"))


def staged(call, pipeline, mesh, checkpoint, rows, keys, configure):
    """The picture's latents (`call(output_type="latent")`), upscaled, redrawn by the family's img2img pipeline
    with the same prompts, guidance and per-image keys."""
    height, width, strength, steps = checkpoint.features["hires"]
    img2img = configure(checkpoint.family.pipeline_class("image")(**pipeline.components()))
    f = pipeline.vae_scale_factor

    def run():
        latents = call(output_type="latent")
        return call(pipe=img2img, images=(upscaled_latents(latents, height // f, width // f),), height=height,
                    width=width, strength=strength, num_inference_steps=steps)
    return run


def steps_after(request, checkpoint) -> int:
    """The steps the redraw runs after the first pass's (the step bar counts both)."""
    from ...pipeline.starts import start_step

    _, _, strength, steps = checkpoint.features["hires"]
    return steps - start_step(steps, strength)


def settings(request, checkpoint) -> dict:
    if "hires" not in checkpoint.features:
        return {}
    height, width, strength, steps = checkpoint.features["hires"]
    return {"hires_scale": request.hires, "hires_strength": strength, "hires_steps": steps,
            "hires_size": f"{width}x{height}"}


def parameters(s) -> str:
    """As A1111 writes its hires fix (Size stays the first pass's)."""
    if "hires_scale" not in s:
        return ""
    return (f", Denoising strength: {s['hires_strength']}, Hires upscale: {s['hires_scale']:g}, Hires steps: "
            f"{s['hires_steps']}, Hires upscaler: Latent")
