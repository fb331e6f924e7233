"""Every public pipeline argument walked with hostile values (NaN, ±inf, 3e38, None, a string, a wrong shape, a
wrong dtype): each is a ValueError / TypeError naming the argument, raised before anything compiles, or a finite
image. The arguments come from the signature, so a new one is walked without editing this file."""

import jax
import numpy as np
import pytest
from test_cli import TINY

import sdflax

HOSTILE = {"nan": float("nan"), "inf": float("inf"), "-inf": -float("inf"), "3e38": 3e38, "None": None, "str": "x",
           "wrong shape": np.ones((2, 3, 5), np.float32), "wrong dtype": np.ones((), np.complex64)}
# Arguments the walk leaves alone, and why.
EXEMPT = {"params": "checked by test_api_bad_input.test_params_must_hold_every_model_and_match_the_mode",
          "jit": "a flag choosing pmap: test_api_bad_input and test_parallel walk it with params"}


@pytest.fixture(scope="module")
def tiny():
    pipe, params = sdflax.StableDiffusion.from_pretrained(TINY)
    base = dict(prompt_ids=pipe.prepare_inputs(["a fox"]), params=params, prng_seed=jax.random.PRNGKey(0),
                num_inference_steps=2)
    return pipe, base, {}


def walked():
    pipe = sdflax.StableDiffusion  # the signature is the class's (the table's)
    return [(name, label) for name in pipe.signature.parameters if name not in EXEMPT for label in HOSTILE]


@pytest.mark.parametrize("name, label", walked())
def test_every_argument_refuses_hostile_values_or_draws_a_finite_image(tiny, name, label):
    pipe, base, images = tiny
    try:
        out = pipe(**{**base, name: HOSTILE[label]}).images
    except (ValueError, TypeError) as e:
        message = str(e)
        assert name in message and "\n" not in message, (name, label, message)
        return
    # accepted (None where it means the default): one or two programs for every accepted value (with and without
    # negative prompt ids)
    assert np.isfinite(out).all() and out.std() > 0, (name, label)
    assert pipe._jitted._cache_size() <= 2
    images.setdefault("first", out)
    if HOSTILE[label] is None and name not in ("prng_seed", "prompt_ids"):
        np.testing.assert_array_equal(out, images["first"])  # None is the default here


def test_hostile_numbers_that_were_taken(tiny):
    """3e38 is finite in float32, yet guidance at that scale overflowed into a black image; complex scales lost
    their imaginary part without a word; callback, guidance and return_trajectory took anything."""
    pipe, base, _ = tiny
    cases = [("guidance_scale", 3e38, "guidance_scale=3e+38 is past 1e+08, where float32 arithmetic overflows"),
             ("guidance_rescale", 3e38, "guidance_rescale=3e+38 is past 1e+08"),
             ("guidance_scale", np.ones((), np.complex64), "guidance_scale must be a number, got"),
             ("latents", np.ones((1, 4, 8, 8), np.complex64), "latents must be an array of real numbers, got "
              "complex64"),
             ("prompt_embeds", np.ones((), np.float32), "prompt_embeds has shape (); it takes a batch, (B, ...)"),
             ("callback", "x", "callback must be a function or None, got 'x' (str)"),
             ("guidance", 3e38, "guidance must be a function or None, got 3e+38 (float)"),
             ("guidance", np.ones((2, 3)), "guidance must be a function or None, got a float64 array of shape (2, 3)"),
             ("return_trajectory", "x", "return_trajectory must be True or False, got 'x' (str)"),
             ("ip_adapter_image_embeds", np.ones((2, 1, 8)), "ip_adapter_image_embeds needs an IP-Adapter")]
    for name, value, expected in cases:
        with pytest.raises((ValueError, TypeError)) as info:
            pipe(**{**base, name: value})
        assert expected in str(info.value), (name, str(info.value))


@pytest.fixture(scope="module")
def conditioned(tmp_path_factory):
    """tiny-sd with a ControlNet, and with a T2I-Adapter: (pipeline, params, the argument that takes its pictures)."""
    from builders import torch_controlnet
    from diffusers import UNet2DConditionModel
    from test_t2i_adapter_pipelines import torch_adapter

    tmp = tmp_path_factory.mktemp("conditioned")
    torch_controlnet(UNet2DConditionModel.from_pretrained(TINY, subfolder="unet"), (8, 16, 16)).save_pretrained(
        tmp / "net")
    torch_adapter(dict(in_channels=3, channels=[32, 64, 64], num_res_blocks=1, downscale_factor=4,
                       adapter_type="full_adapter"), 1).save_pretrained(tmp / "adapter")
    net, net_params = sdflax.ControlNetModel.from_pretrained(tmp / "net")
    adapter, adapter_params = sdflax.T2IAdapter.from_pretrained(tmp / "adapter")
    controlled, params = sdflax.StableDiffusionControlNet.from_pretrained(TINY, controlnet=net)
    adapted = sdflax.StableDiffusionAdapter.from_pretrained(TINY, adapter=adapter)[0]
    return [(controlled, {**params, "controlnet": net_params}, "control_image"),
            (adapted, {**params, "adapter": adapter_params}, "adapter_image")]


@pytest.mark.parametrize("picture", [None, [None], "edges.png"], ids=["None", "[None]", "str"])
def test_missing_control_and_adapter_pictures_are_named_inside_a_callers_jit(conditioned, picture):
    """`_generate` skips the checks of values, which a caller's jit traces: a ControlNet's or T2I-Adapter's
    picture given as None was an AttributeError ('NoneType' object has no attribute 'shape') there, and the
    ControlNet's in the checked call too; a file name, numpy's "could not convert string to float"."""
    for pipe, params, name in conditioned:
        call = dict(prompt_ids=pipe.prepare_inputs(["a fox"]), image=picture, params=params,
                    prng_seed=jax.random.PRNGKey(0), num_inference_steps=2)
        for run in (lambda: jax.jit(lambda ids: pipe._generate(**{**call, "prompt_ids": ids}))(call["prompt_ids"]),
                    lambda: pipe(**call)):
            with pytest.raises((ValueError, TypeError)) as error:
                run()
            message = str(error.value)
            assert name in message and "prepare_image_inputs(pictures)" in message and "\n" not in message, message
            if picture is None:
                assert f"this pipeline has {'ControlNets' if 'control' in name else 'T2I-Adapters'}, but {name} is " \
                       "not given: give their" in message, message
