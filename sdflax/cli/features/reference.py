"""--reference IMG: Flux.1 Kontext's reference picture, the image the prompt edits (`sdflax.FluxKontext`: its
latents are extra tokens the transformer attends to). The image is made at its size unless --width and --height
say otherwise (it is then resized to theirs)."""

from __future__ import annotations

from ..pictures import read_picture

FLAG = "--reference"
DENOISERS = ()
FAMILIES = ("flux",)


def add_flags(add, command):
    if command != "generate":  # img2img and inpaint start from their own --image
        return
    add("--reference", metavar="IMG", help="Flux.1 Kontext: the picture the prompt edits (e.g. 'make it a "
        "watercolor'); the output takes its size")


def used(request) -> bool:
    return request.reference is not None


def check_flags(request, batch):
    """The picture is readable (and not too large to read)."""
    if request.reference is not None:
        pictures(request)


def pictures(request) -> tuple:
    if request.reference is None:
        return "--reference", (), ()
    return "--reference", (request.reference,), (read_picture("--reference", request.reference).convert("RGB"),)


def pipeline_class(request, family, cls):
    return family.classes["FluxKontext"]


def resolve(request, configs, pictures):
    """The reference, at the output size."""
    return pictures[0]


def call_arguments(pipeline, picture, rows) -> tuple[list, dict]:
    """The reference's pixels, the same for every row (the call's `image`)."""
    import numpy as np

    from ...pipeline.images import preprocess_images

    return [np.repeat(preprocess_images([picture], pipeline.vae_scale_factor), len(rows), axis=0)], {}


def settings(request, checkpoint) -> dict:
    return {"reference": request.reference} if request.reference is not None else {}
