"""Every argument of every guider in sdflax.guiders walked with hostile values (NaN, ±inf, 3e38, None, a string, a
wrong shape, a wrong dtype): each is a ValueError / TypeError naming the guider and the argument, raised at
construction, or a guider whose arithmetic gives finite numbers. The classes and their arguments come from the
package and the dataclass fields, so a new guider or argument is walked without editing this file. Nothing here
runs a model: the guider combines small arrays, as the scan would hand it the UNet's chunks."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sdflax.guiders as guiders
from sdflax import sampling
from sdflax.guiders.perturbed import PerturbsLayers

HOSTILE = {"nan": float("nan"), "inf": float("inf"), "-inf": -float("inf"), "3e38": 3e38, "None": None, "str": "x",
           "wrong shape": np.ones((2, 3, 5), np.float32), "complex": np.ones((), np.complex64),
           "bool array": np.ones((), bool)}
# (guider class name, argument) -> why the walk leaves it alone; none so far
EXEMPT: dict = {}
LAYER = {"indices": [0], "fqn": "mid_block.attentions.0.transformer_blocks"}
STEPS = 4


def guider_classes():
    return [cls for name in guiders.__all__ if isinstance(cls := getattr(guiders, name), type)
            and issubclass(cls, guiders.Guider) and cls is not guiders.Guider]


def required(cls) -> dict:
    """The arguments a guider cannot be made without: a layer config for those that perturb layers."""
    return {cls.arguments.config: LAYER} if issubclass(cls, PerturbsLayers) else {}


def walked():
    return [pytest.param(cls, field.name, label, id=f"{cls.__name__}-{field.name}-{label}")
            for cls in guider_classes() for field in dataclasses.fields(cls)
            if (cls.__name__, field.name) not in EXEMPT for label in HOSTILE]


def guided(guider):
    """The guider's prediction at each of STEPS evaluations, from small random chunks, its memory (APG's
    momentum) carried from one to the next, its numbers float32 arrays as `Pipeline.with_guider` makes them."""
    guider = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), guider)
    rng = np.random.default_rng(0)
    chunks = [rng.standard_normal((1, 4, 8, 8), dtype=np.float32) for _ in range(2 + len(guider.extra_predictions))]
    memory, predictions = None, []
    for step in range(STEPS):
        with sampling.scope(step, memory, num_steps=STEPS) as scope:
            predictions.append(np.asarray(guider.combine(chunks, None, None)))
            memory = scope.memory
    return np.stack(predictions)


def test_the_walk_finds_every_guider():
    names = {cls.__name__ for cls in guider_classes()}
    assert {"ClassifierFreeGuidance", "AdaptiveProjectedGuidance", "FrequencyDecoupledGuidance", "AutoGuidance",
            "SmoothedEnergyGuidance"} <= names and len(names) == 11


@pytest.mark.parametrize("cls", guider_classes(), ids=lambda cls: cls.__name__)
def test_every_guider_at_its_defaults_gives_finite_numbers(cls):
    assert np.isfinite(guided(cls(**required(cls)))).all()


@pytest.mark.parametrize("cls, name, label", walked())
def test_every_guider_argument_refuses_hostile_values_or_guides_finitely(cls, name, label):
    try:
        guider = cls(**{**required(cls), name: HOSTILE[label]})
    except (ValueError, TypeError) as e:
        message = str(e)
        assert name in message and cls.__name__ in message and "\n" not in message, message
        return
    default = next(f for f in dataclasses.fields(cls) if f.name == name).default
    assert HOSTILE[label] is None and (default is None or name in cls.optional_arguments), (name, label)
    assert np.isfinite(guided(guider)).all()


@pytest.mark.parametrize("make, expected", [
    (lambda: guiders.AdaptiveProjectedGuidance(eta=None), "AdaptiveProjectedGuidance: eta=None must be a number"),
    (lambda: guiders.AdaptiveProjectedGuidance(eta=np.ones((2, 3, 5), np.float32)),
     "AdaptiveProjectedGuidance: eta=<float32 array of shape (2, 3, 5)> must be a number"),
    (lambda: guiders.MagnitudeAwareGuidance(alpha=1 + 2j), "MagnitudeAwareGuidance: alpha=(1+2j) must be a real number"),
    (lambda: guiders.ClassifierFreeGuidance(np.ones((), bool)), "guidance_scale=array(True) must be a number"),
    (lambda: guiders.ClassifierFreeGuidance(use_original_formulation="no"),
     "ClassifierFreeGuidance: use_original_formulation='no' must be True or False"),
    (lambda: guiders.TangentialClassifierFreeGuidance(enabled=None),
     "TangentialClassifierFreeGuidance: enabled=None must be True or False"),
    (lambda: guiders.FrequencyDecoupledGuidance(upcast_to_double=np.nan), "upcast_to_double=nan must be True or False"),
    (lambda: guiders.FrequencyDecoupledGuidance(guidance_scales=[1.0, "x"]),
     "guidance_scales=[1.0, 'x'] must be a number, or a list of them, one per level"),
    (lambda: guiders.FrequencyDecoupledGuidance(guidance_rescale_space=np.ones(3)),
     "guidance_rescale_space=<float64 array of shape (3,)> must be 'data' or 'freq'"),
    (lambda: guiders.PerturbedAttentionGuidance(perturbed_guidance_config="x"),
     "PerturbedAttentionGuidance: perturbed_guidance_config='x' must be a LayerSkipConfig, a dict of its fields"),
    (lambda: guiders.SkipLayerGuidance(skip_layer_guidance_layers=np.ones(3), skip_layer_config=LAYER),
     "skip_layer_guidance_layers=<float64 array of shape (3,)> must be None, a block index or a list of them"),
    (lambda: guiders.AutoGuidance(auto_guidance_config=LAYER, dropout=0.5),
     "AutoGuidance: dropout=0.5 applies to the configs made from auto_guidance_layers"),
    (lambda: guiders.ClassifierFreeGuidance(start=np.ones((2, 3))), "start=<float64 array of shape (2, 3)> must be"),
    (lambda: guiders.MagnitudeAwareGuidance(alpha=-58.0), "MagnitudeAwareGuidance: alpha=-58.0 must be 0 or above"),
])
def test_guider_arguments_that_were_taken(make, expected):
    """None, arrays of any shape, complex and boolean numbers passed check_numbers and failed while tracing (or
    lost their imaginary part); flags took anything truthy; a config of the wrong kind was a TypeError naming no
    argument; AutoGuidance's dropout beside a config was ignored; an array's repr spread a message over lines;
    MAG's damping exp(−α ratio) overflowed float32 for α below about −60 (the fuzz found −58 at a ratio near 1.5)."""
    with pytest.raises((ValueError, TypeError)) as error:
        make()
    assert expected in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_accepted_numbers_stay_accepted():
    """Numbers as a caller gives them: Python ints and floats, numpy and jax 0-d arrays, per-level lists."""
    guiders.ClassifierFreeGuidance(np.float32(5.0), guidance_rescale=jnp.asarray(0.5))
    guiders.ClassifierFreeZeroStarGuidance(zero_init_steps=np.int64(2), use_original_formulation=np.True_)
    guiders.FrequencyDecoupledGuidance(guidance_scales=[np.float32(4.0), 2], parallel_weights=(0.5, 0.5))
    guiders.AdaptiveProjectedMixGuidance(adaptive_projected_guidance_momentum=None)


def test_zero_star_with_rescale_starts_from_zero_not_nan():
    """CFG-Zero*'s first evaluations predict zero; diffusers then rescales that zero by std(ε(c)) / 0, a NaN image
    (as did sdflax): the zero stands, and later steps are rescaled."""
    predictions = guided(guiders.ClassifierFreeZeroStarGuidance(guidance_rescale=0.7, zero_init_steps=2))
    assert (predictions[:2] == 0).all() and np.isfinite(predictions).all() and (predictions[2:] != 0).any()
