"""PNDM sampler: Liu et al. 2022, "Pseudo Numerical Methods for Diffusion Models on Manifolds" (PRK warm-up + PLMS)."""

from __future__ import annotations

import dataclasses

import flax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import common

# Which combination of model outputs ε drives a step (index into lax.select_n in `step`).
PLAIN, HEUN, AB2, AB3, AB4, RK4 = range(6)


@dataclasses.dataclass(frozen=True)
class PNDMConfig(common.ScheduleConfig):
    skip_prk_steps: bool = False
    allowed_prediction_types = ("epsilon", "v_prediction")


@flax.struct.dataclass
class PNDMState:
    timesteps: jnp.ndarray  # int32 [n_evals]: the timestep of every model evaluation
    alpha_prod_t: jnp.ndarray  # float32 [n_evals]: ᾱ of the point the step starts from
    alpha_prod_t_prev: jnp.ndarray  # float32 [n_evals]: ᾱ of the point the step lands on
    formula: jnp.ndarray  # int32 [n_evals]: PLAIN..RK4
    push_ets: jnp.ndarray  # bool [n_evals]: append this ε to the multistep history
    save_sample: jnp.ndarray  # bool [n_evals]: remember this x as the start of the (RK / Heun) step
    from_saved_sample: jnp.ndarray  # bool [n_evals]: step from the remembered x instead of the current one
    rk_weight: jnp.ndarray  # float32 [n_evals]: RK4 weight of this ε in the running sum
    alpha_prod_model: jnp.ndarray  # float32 [n_evals]: ᾱ at timesteps[i], where the model was evaluated
    ets: jnp.ndarray  # float32 [4, *shape]: last four ε, newest last
    saved_sample: jnp.ndarray  # float32 [*shape]
    rk_sum: jnp.ndarray  # float32 [*shape]: Σ of the weighted RK4 stages so far
    num_inference_steps: int = flax.struct.field(pytree_node=False)
    init_noise_sigma: float = flax.struct.field(pytree_node=False, default=1.0)  # x_T ~ N(0, I)


@dataclasses.dataclass(frozen=True)
class PNDMScheduler(common.SchedulerBase):
    config: PNDMConfig

    def check_steps(self, num_inference_steps: int) -> None:
        """As every scheduler's, and n >= 4 for the PRK warm-up (three RK4 steps over the last four timesteps)."""
        super().check_steps(num_inference_steps)
        if not self.config.skip_prk_steps and num_inference_steps < 4:
            raise ValueError(f"PNDM with PRK steps needs num_inference_steps >= 4, got {num_inference_steps}")

    def set_timesteps(self, num_inference_steps: int, shape: tuple[int, ...] | None = None, start: int = 0
                      ) -> PNDMState:
        """Unroll diffusers' stateful step() into per-evaluation tables (plain numpy, at trace time).
        `start` skips that many evaluations, as img2img does."""
        if shape is None:
            raise ValueError("PNDM keeps a history of model outputs: call set_timesteps(n, shape=sample.shape)")
        self.check_steps(num_inference_steps)
        cfg, n = self.config, num_inference_steps
        alpha_prod, final_alpha_prod = common.alphas_cumprod(cfg)
        spaced = common.spaced_timesteps(cfg, n)[::-1]  # ascending
        delta = cfg.num_train_timesteps // n
        if cfg.skip_prk_steps:
            prk = np.array([], np.int64)
            # The second evaluation revisits the first landing point (it becomes a Heun step, see below).
            plms = np.concatenate([spaced[:-1], spaced[-2:-1], spaced[-1:]])[::-1]
        else:
            # Three RK4 steps over the last 4 timesteps, each evaluated at t, t - δ/2, t - δ/2, t - δ.
            prk = spaced[-4:].repeat(2) + np.tile([0, delta // 2], 4)
            prk = prk[:-1].repeat(2)[1:-1][::-1]
            plms = spaced[:-3][::-1]

        # img2img begins `start` evaluations in; diffusers' `counter` then restarts at 0 on the rest.
        evaluations = np.concatenate([prk, plms])
        common.check_start(start, len(evaluations))
        evaluations = evaluations[start:]
        rows = []  # (t, t_from, t_to, formula, push_ets, save_sample, from_saved_sample, rk_weight)
        n_ets = 0
        for c, t in enumerate(evaluations):  # c is diffusers' `counter`
            if c < len(prk):
                stage = c % 4
                t_to = t - (0 if c % 2 else delta // 2)
                formula = RK4 if stage == 3 else PLAIN
                rows.append((t, prk[c - stage], t_to, formula, stage == 0, stage == 0, True,
                             (1 / 6, 1 / 3, 1 / 3, 0)[stage]))
                n_ets += stage == 0
                continue
            if c == 1:  # re-evaluation at the landing point of step 0: redo step 0 with the averaged ε
                rows.append((t, t + delta, t, HEUN, False, False, True, 0.0))
                continue
            n_ets = min(n_ets + 1, 4)
            formula = (PLAIN, AB2, AB3, AB4)[n_ets - 1]
            rows.append((t, t, t - delta, formula, True, c == 0, False, 0.0))

        t, t_from, t_to, formula, push, save, from_saved, rk_weight = (np.array(col) for col in zip(*rows))
        zeros = jnp.zeros(tuple(shape), jnp.float32)
        return PNDMState(
            timesteps=jnp.asarray(t, jnp.int32),
            alpha_prod_t=jnp.asarray(common.alpha_prod_at(alpha_prod, final_alpha_prod, t_from)),
            alpha_prod_t_prev=jnp.asarray(common.alpha_prod_at(alpha_prod, final_alpha_prod, t_to)),
            formula=jnp.asarray(formula, jnp.int32),
            push_ets=jnp.asarray(push, bool),
            save_sample=jnp.asarray(save, bool),
            from_saved_sample=jnp.asarray(from_saved, bool),
            rk_weight=jnp.asarray(rk_weight, jnp.float32),
            alpha_prod_model=jnp.asarray(common.alpha_prod_at(alpha_prod, final_alpha_prod, t)),
            ets=jnp.zeros((4, *shape), jnp.float32),
            saved_sample=zeros,
            rk_sum=zeros,
            num_inference_steps=n,
        )

    def scale_model_input(self, state: PNDMState, sample, i):
        return sample

    def predict_x0(self, state: PNDMState, model_output, i, sample):
        """x̂_0 = (x_t - √(1-ᾱ_t) ε̂) / √ᾱ_t from this evaluation's own output, t = timesteps[i]. float32."""
        pred_x0, _ = common.predict_x0_and_epsilon(
            model_output, sample, *common.alpha_sigma(state.alpha_prod_model[i]), self.config.prediction_type)
        return pred_x0

    def add_noise(self, state: PNDMState, original_samples, noise, i):
        """q(x_t | x_0): √ᾱ_t x_0 + √(1-ᾱ_t) ε at t = timesteps[i] (img2img's start)."""
        return common.add_noise(original_samples, noise, state.alpha_prod_model[i])

    def step(self, state: PNDMState, model_output, i, sample, key=None):
        eps = model_output.astype(jnp.float32)
        x = sample.astype(jnp.float32)

        # ets = ets[-3:] + [eps] when pushing
        ets = jnp.where(state.push_ets[i], jnp.concatenate([state.ets[1:], eps[None]]), state.ets)
        e1, e2, e3, e4 = ets[3], ets[2], ets[1], ets[0]  # e1 newest
        combined = lax.select_n(
            state.formula[i],
            eps,  # PLAIN: first PLMS step, or RK stages 1-3
            (eps + e1) / 2,  # HEUN: (ε(x_{t-δ}) + ε(x_t)) / 2 from x_t again (ets not pushed, e1 is ε(x_t))
            (3 * e1 - e2) / 2,  # AB2
            (23 * e1 - 16 * e2 + 5 * e3) / 12,  # AB3
            (1 / 24) * (55 * e1 - 59 * e2 + 37 * e3 - 9 * e4),  # AB4, the PLMS step proper (paper eq. 12)
            state.rk_sum + (1 / 6) * eps,  # RK4: (k1 + 2 k2 + 2 k3 + k4) / 6
        )
        # rk_sum += w * eps, and restarts from 0 once an RK4 step is complete
        rk_sum = jnp.where(state.formula[i] == RK4, 0.0, state.rk_sum + state.rk_weight[i] * eps)
        saved_sample = jnp.where(state.save_sample[i], x, state.saved_sample)
        x_from = jnp.where(state.from_saved_sample[i], saved_sample, x)

        alpha_prod_t, alpha_prod_t_prev = state.alpha_prod_t[i], state.alpha_prod_t_prev[i]
        # v-prediction is converted to ε after combining, from the sample the step starts at (as diffusers)
        _, combined = common.predict_x0_and_epsilon(combined, x_from, *common.alpha_sigma(alpha_prod_t),
                                                    self.config.prediction_type)

        # Transfer x_t -> x_{t-δ} along the DDIM path with ε held fixed (paper eq. 11):
        #   x_{t-δ} = √(ᾱ_{t-δ}/ᾱ_t) x_t - (ᾱ_{t-δ} - ᾱ_t) ε / (ᾱ_t √(1-ᾱ_{t-δ}) + √(ᾱ_t (1-ᾱ_t) ᾱ_{t-δ}))
        beta_prod_t, beta_prod_t_prev = 1.0 - alpha_prod_t, 1.0 - alpha_prod_t_prev
        sample_coeff = jnp.sqrt(alpha_prod_t_prev / alpha_prod_t)
        eps_denominator = alpha_prod_t * jnp.sqrt(beta_prod_t_prev) + jnp.sqrt(
            alpha_prod_t * beta_prod_t * alpha_prod_t_prev
        )
        prev_sample = sample_coeff * x_from - (alpha_prod_t_prev - alpha_prod_t) * combined / eps_denominator

        state = state.replace(ets=ets, saved_sample=saved_sample, rk_sum=rk_sum)
        return prev_sample.astype(sample.dtype), state
