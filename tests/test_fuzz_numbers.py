"""Property-based fuzzing of the API's traced numbers (hypothesis): floats of every kind (NaN, ±inf, past float32,
subnormal, negative), integers, booleans, complex numbers, strings, None and small arrays of several dtypes, given to
the pipeline's checks of call arguments, to every guider's constructor and to a scheduler's custom `timesteps=` /
`sigmas=`. Each is refused with a ValueError / TypeError naming the argument, in one line, or taken, and then
everything it gives is finite in float32. Nothing here compiles a model.

CI runs a fixed number of examples from a fixed seed (derandomized); `SDFLAX_FUZZ_EXAMPLES=2000 pytest
tests/test_fuzz_numbers.py` runs longer."""

import dataclasses
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from test_guider_walk import guided, guider_classes, required

from sdflax.guiders.base import NUMBER_BOUND
from sdflax.pipeline.arguments import NUMBERS, check_kinds
from sdflax.pipeline.checks import check_finite
from sdflax.schedulers import common
from sdflax.schedulers.euler import EulerScheduler

EXAMPLES = int(os.environ.get("SDFLAX_FUZZ_EXAMPLES", 100))
FUZZ = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])

FLOATS = st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True) | st.sampled_from(
    [3e38, -3e38, 1e8, -1e8, 1.0000001e8, 1e-45, -0.0, 1e300, -1e300])
SMALL_ARRAYS = hnp.arrays(st.sampled_from([np.float32, np.float64, np.float16, np.int32, np.bool_, np.complex64]),
                          hnp.array_shapes(min_dims=0, max_dims=3, max_side=3))
NUMBERS_OF_EVERY_KIND = (FLOATS | st.integers(-10 ** 40, 10 ** 40) | st.booleans() | st.complex_numbers()
                         | st.none() | st.text(max_size=3) | SMALL_ARRAYS | st.lists(FLOATS, max_size=3))


def refused_naming(error, name):
    message = str(error)
    assert name in message and "\n" not in message, (name, message)


def float32_finite(value) -> bool:
    with np.errstate(all="ignore"):
        return bool(np.isfinite(np.asarray(value, np.float32)).all())


@FUZZ
@given(name=st.sampled_from(NUMBERS), value=NUMBERS_OF_EVERY_KIND)
def test_call_numbers_are_refused_naming_them_or_finite_in_float32(name, value):
    """The checks a call's numbers meet before anything is traced: check_kinds, then check_finite."""
    args = {"guidance_scale": 7.5, name: value}  # guidance_scale has no None: it is always given
    try:
        check_kinds(args)
        check_finite(args)
    except (ValueError, TypeError) as e:
        refused_naming(e, name)
        return
    if value is not None:
        assert float32_finite(value) and np.abs(np.asarray(value, np.float64)).max(initial=0) <= NUMBER_BOUND


TRACED = [(cls, field.name) for cls in guider_classes() for field in dataclasses.fields(cls)
          if field.metadata.get("pytree_node", True)]


@FUZZ
@given(argument=st.sampled_from(TRACED), value=NUMBERS_OF_EVERY_KIND)
def test_guider_numbers_are_refused_naming_them_or_guide_finitely(argument, value):
    cls, name = argument
    try:
        guider = cls(**{**required(cls), name: value})
    except (ValueError, TypeError) as e:
        refused_naming(e, name)
        assert cls.__name__ in str(e)
        return
    assert np.isfinite(guided(guider)).all(), (cls.__name__, name, value)


SCHEDULES = st.lists(FLOATS | st.integers(-10, 2000), min_size=0, max_size=6) | NUMBERS_OF_EVERY_KIND


@FUZZ
@given(kind=st.sampled_from(["timesteps", "sigmas"]), values=SCHEDULES)
def test_custom_schedules_are_refused_naming_them_or_finite_in_float32(kind, values):
    """`with_schedule(timesteps=)` / `(sigmas=)`, as the pipeline's `timesteps=` / `sigmas=` reach it: refused, or
    a schedule whose timesteps, σ and initial noise scale are finite float32 numbers."""
    try:
        scheduler = EulerScheduler.from_config({}).with_schedule(**{kind: values})
    except (ValueError, TypeError) as e:
        refused_naming(e, kind)
        return
    steps = common.custom_steps(scheduler.config)
    if values is None:  # None: the scheduler's own spacing, as diffusers'
        assert steps is None
        return
    state = scheduler.set_timesteps(steps)
    assert len(state.timesteps) == steps
    assert float32_finite(state.timesteps) and float32_finite(state.sigmas) and np.isfinite(state.init_noise_sigma)


@pytest.mark.parametrize("kind, values, expected", [
    ("sigmas", [1e300, 0.0], "sigmas holds NaN, inf or a number past float32's range (about 3.4e38)"),
    ("sigmas", [4e38, 1.0, 0.0], "sigmas holds NaN, inf or a number past float32's range (about 3.4e38)"),
    ("timesteps", [999.0, float("nan")], "timesteps must be a list of finite numbers (in float32"),
])
def test_schedules_past_float32_are_refused(kind, values, expected):
    """Finiteness was tested in float64: σ = 1e300 passed, and was inf in the float32 schedule."""
    with pytest.raises(ValueError) as error:
        EulerScheduler.from_config({}).with_schedule(**{kind: values})
    assert expected in str(error.value)
