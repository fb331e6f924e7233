"""--eta: the share of fresh noise a sampler that takes one adds each step (DDIM's η: 0 deterministic, 1 DDPM-like;
DPM++ 3M SDE's and TCD's), as A1111's "Eta" setting; the scheduler's config `eta`, as `scheduler_config={"eta": ...}`
gives it in the library."""

from __future__ import annotations

import dataclasses

from ..parse import number
from ..request import UserError

FLAG = "--eta"

eta = number(lambda v: 0 <= v <= 1e8, "must be a number in [0, 1e8], got {text}: 0 adds no noise (DDIM "
             "deterministic), 1 is DDPM-like")


def add_flags(add, command):
    add("--eta", type=eta, metavar="ETA", help="the noise a sampler with an eta adds each step (ddim: 0 "
        "deterministic, 1 DDPM-like; dpmpp_3m_sde, tcd), as A1111's Eta (default: the sampler's own)")


def used(request) -> bool:
    return request.eta is not None


def takes_eta(scheduler) -> bool:
    config = scheduler.config
    return dataclasses.is_dataclass(config) and any(field.name == "eta" for field in dataclasses.fields(config))


def check_configs(request, configs):
    """The checkpoint's scheduler, or --scheduler's, takes an eta."""
    if not takes_eta(configs.scheduler):
        given = f"--scheduler {request.scheduler}" if request.scheduler else f"{request.model}'s scheduler"
        raise UserError(f"--eta applies to the samplers that add noise by an eta (DDIM, DPM++ 3M SDE, TCD), and "
                        f"{given} ({type(configs.scheduler).__name__}) has none: drop --eta, or add --scheduler ddim")


def load(request, pipeline, params, dtype):
    """The pipeline with its scheduler's eta set, as `from_pretrained(scheduler_config={"eta": ...})` sets it."""
    scheduler = pipeline.scheduler
    scheduler = dataclasses.replace(scheduler, config=dataclasses.replace(scheduler.config, eta=request.eta))
    return pipeline.replace(scheduler=scheduler), params


def settings(request, checkpoint) -> dict:
    return {"eta": request.eta} if request.eta is not None else {}


def parameters(s) -> str:
    """As A1111 writes its eta."""
    return f", Eta: {s['eta']}" if "eta" in s else ""
