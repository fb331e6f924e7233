"""The command line's features: each module is one addition a request may use (SD 3's and Flux.1's own flags, T5's
sequence length, Kontext's reference picture, a refiner, a VAE, LoRAs, embeddings, a sampler's eta, a guider, ControlNets, IP-Adapters,
T2I-Adapters, A1111's prompt syntax, clip skip and hires fix, pictures of the sampler: its trajectory, attention
maps), holding its flags, its checks, its loading, its call arguments and its PNG text. The commands loop over
`FEATURES`; a module defines the functions it needs:

    FLAG                                 the flag that turns it on, named in messages
    DENOISERS                            the denoiser components it takes ("unet"); absent: every one
    FAMILIES                             families it takes beside those (by name: "flux"), where DENOISERS is given
    add_flags(add, command)              its flags: `add(flag, **argparse keywords)`; command: generate, img2img,
                                         inpaint or batch
    used(request) -> bool                whether the request uses it (the steps below run for those that do)
    check_flags(request, batch)          before anything loads: its flags agree, its files and pictures are there
    check_lines(request, lines, prompts) `sdflax batch`: against the prompt file's lines (their own values)
    pipeline_class(request, family, cls) -> the pipeline class of the request's cell, where it picks one
    check_configs(request, configs)      against the checkpoint's configs (kilobytes), before the output size
    pictures(request) -> (flag, paths, pictures)   pictures resized to the output size; where no --image sets
                                         it, the first feature's first picture does
    resolve(request, configs, pictures) -> what the run uses, `Checkpoint.features[name]`, once the size is known
    prompt_arguments(rows, negative)     `prepare_inputs`' keywords
    components(request, dtype) -> (components, params)   models the pipeline is made with (controlnet=)
    load(request, pipeline, params, dtype) -> (pipeline, params)   after the pipeline loads
    configure(pipeline, value) -> pipeline   the pipeline (and a refiner) the call runs
    call_arguments(pipeline, value, rows) -> (positional arrays, keywords) of `generate_sharded`
    next_stage(request, checkpoint, dtype)   what the call hands its latents to (a refiner: its pipeline, params),
                                         loaded with the pipeline; `staged(call, stage, ...)` runs both;
                                         `steps_after(request, checkpoint)`: the steps it adds
    settings(request, checkpoint) -> dict    its PNG text chunks (none where unused)
    write(request, made)                 after the images are written: more pictures from `request.Made` (the
                                         call's trajectory: --trajectory, --attention-maps)
    parameters(settings) -> str          its part of A1111's `parameters` line; `prompt_parameters`: of its prompt;
                                         `scale_parameters` -> str | None: the guidance scales' entries, in place
                                         of "CFG scale: <guidance_scale>" (Flux.1's true and distilled ones)

The order of `FEATURES` is the order of the PNG's entries and of the call's positional pictures.
"""

from __future__ import annotations

from . import (attention_maps, clip_skip, controlnet, embedding, eta, flux_flags, guider, hires, ip_adapter, lora,
               prompt_syntax, reference, refiner, sd3_flags, t2i_adapter, t5, trajectory, vae)

FEATURES = (sd3_flags, flux_flags, t5, reference, refiner, vae, lora, embedding, eta, guider, controlnet, ip_adapter,
            t2i_adapter, prompt_syntax, clip_skip, hires, trajectory, attention_maps)


def name(feature) -> str:
    return feature.__name__.rpartition(".")[2]


def used(request) -> tuple:
    """The features the request uses, in their order."""
    return tuple(feature for feature in FEATURES if feature.used(request))


def having(function, features=FEATURES) -> tuple:
    """(feature, its `function`) of the features that define it."""
    return tuple((feature, getattr(feature, function)) for feature in features if hasattr(feature, function))

