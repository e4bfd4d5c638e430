"""One gradient-noise estimate per run, with standard errors, from every source that measured it.

Each source (micro-batches and ranks; per-example norms; a ``torch.func`` sub-batch) keeps its own
bias-corrected EMAs of ‖G‖²_est and S_est ≈ tr(Σ) (:class:`~trainvitals.noise.estimators.NoiseScaleEMA`)
and of their second moments (:class:`~trainvitals.noise.estimators.NoiseScaleError`): the spread of the
per-step estimates about their EMA gives the sampling variance of each EMA mean. A source states
which parameters it covers (share of the trainable parameters and, per step, of ‖ḡ‖²) and can be
marked invalid: one that is known not to estimate sampling noise (per-example gradients through a
BatchNorm in training mode, which couples the examples) never enters the estimate.

Combining rule (:meth:`GradientNoise.estimate`):

1. Only valid sources with at least one update take part, and only those covering the largest share
   of the parameters: sources over different parameter sets estimate different quantities and are
   never averaged (like with like).
2. ‖G‖² and tr(Σ) are each the inverse-variance weighted mean of those sources' EMAs, in the units
   of ``.grad`` (each source states its unit factor).
3. The sources see the same examples, so their errors may be correlated, up to fully. The standard
   error of the combination is therefore Σ_k w_k·σ_k (errors add as standard deviations), an upper
   bound for any correlation between sources; with one source it is that source's own (exact to
   first order). B_simple's relative error follows by the delta method, per source with its own
   covariance of (S̄, Ḡ), added the same way; the noise level sqrt(tr Σ/B) has half tr(Σ)'s relative
   error.
4. The estimate is *decisive* (a noise-band stop, noise-aware lr advice) only when it covers at least
   ``min_coverage`` of ‖ḡ‖² (default 0.9) and the tr(Σ) it cannot see is bounded by a tenth of what it
   measured (:data:`MAX_UNMEASURED_TRACE`). A share of ‖ḡ‖² does not bound tr(Σ) by itself: ‖ḡ‖² =
   ‖G‖² + tr Σ/B is signal-dominated when B > B_simple, and the unmeasured parameters' part u‖ḡ‖²
   (u = 1 − coverage) can hold up to B·u·‖ḡ‖² of tr Σ (their E‖ḡ_u‖² ≥ tr Σ_u/B). With the measured
   part's ‖ḡ_m‖² = c‖ḡ‖² ≈ ‖G‖² + tr Σ/B (c the coverage), that bound is, as a share of the measured tr Σ,
   (u/c)·(1 + B/B_simple); drawn without replacement from N examples (rule 6) E‖ḡ_u‖² ≥ f·tr Σ_u/B with
   f = (N − B)/(N − 1), and the bound is (u/c)·(1 + B/(f·B_simple)): ``unmeasured_trace_share``.
   Nothing is decisive before :data:`MIN_MEASUREMENTS`
   updates: the errors come from the spread of the updates, and with a few of them they are themselves
   too uncertain (90% intervals covered the truth in 71–86% of trials with 3–10). Noise-aware advice also
   needs B_simple's relative error ≤ ``max_rel_err`` (default 0.5: the lr suggestions then stay within
   about ×1.5 either way), read off the interval B_simple is quoted with (rule 8), so that the flag and the
   interval cannot disagree: ``b_simple_rel_err`` is the larger distance of a Fieller end from B_simple in
   units of z·B_simple (B_simple·(1 ± z·rel_err) contains the interval; :func:`fieller_rel_err`), ``inf``
   where the interval has no upper end (‖G‖² within its error of zero). Reliable: decisive, ‖G‖² > 0 and that
   relative error ≤ ``max_rel_err``; an asymmetric interval is judged by its farther end.

5. Coupled examples. A per-example source assumes independent examples; batch statistics (BatchNorm, or
   ``F.batch_norm(training=True)`` in a custom module) or a loss coupling the examples (in-batch negatives,
   as in a contrastive InfoNCE loss) break that without any module saying so. Two signs give it away, checked
   on logging steps (:meth:`GradientNoise.disagreement`) once a source has :data:`MIN_MEASUREMENTS`: its
   ‖G‖² on its band window, with that window's sampling error alone, is below zero by more than
   :data:`COUPLING_Z` standard errors, Student-widened at the window's effective measurements
   (:func:`coupling_shown`: independent examples give E[‖G‖²_est] = ‖G‖² ≥ 0 at every step, so any window's
   mean has a non-negative expectation, lag or none; a negative value within its error is a legitimate
   "G ≈ 0"; a normal 3σ on a short window, checked at every logging step, is a false alarm), or it
   disagrees with the micro-batch/rank source beyond :data:`AGREEMENT_Z` standard errors on their band windows, with
   their sampling errors alone (:func:`sources_apart`, Student-widened at the fewer effective measurements of the
   two). Sources measured at the same steps weight them alike, so a lag is common to both windows and cancels;
   compared each on its chosen window with its estimated lag in its error, a lag the estimate missed (tr Σ doubling
   in 30 steps) dropped a correct probe in 9–13 % of closed-form runs (tests/noise/test_coupling.py). The band windows
   of sources at different cadences span nearly the same steps (rule 7); the offset of their mean ages, in optimizer
   steps, times the drift per step their lags give (:meth:`NoiseSource.band_drift`) is added to the error. The
   micro-batches are independent
   by construction, so that source decides: the other is marked invalid, dropped, and said once. Between
   logging steps the band never holds on a ‖G‖² below zero beyond its error.

6. Finite population. Drawing a batch without replacement from N examples (a shuffled epoch) shrinks
   the batch mean's variance by (N − B)/(N − 1), and the estimators above, made for independent draws,
   then give E[‖G‖²_est] = ‖G‖² − S/N and E[S_est] = S = N·tr Σ/(N − 1), for per-example and micro-batch
   sources alike (the finite-population correction of survey sampling, Cochran 1977, *Sampling
   Techniques*, §2.5). With N known (:attr:`GradientNoise.population`) each source is corrected:
   ‖G‖² = ‖G‖²_est + S_est/N, tr Σ = S_est·(N − 1)/N, their variances carried along.
   While training on a shuffled epoch the step's batch is drawn from the examples R the epoch has left, and θ
   has moved on those it drew: the estimate is then unbiased for ‖G‖² + 2·G·(G_R − G), not the full-data ‖G‖²
   (G_R the mean gradient over R; the excess is 0 at an epoch's first step, with replacement or θ frozen, and
   positive on average while training: for SGD on a quadratic with η·h ≤ 1 below 2·tr S/N = 2·tr Σ/(N − 1), the
   band ratio at most 2B/(margin·N) high; 2.0–2.9× the full-data ‖G‖² on two Adam fits; docs/science.md, "Under
   random reshuffling"; tests/noise/test_reshuffling.py). Where each epoch reshuffles (``RandomSampler`` without
   replacement, a shuffling ``DistributedSampler``: :attr:`NoiseSource.reshuffled`) the full-data intervals
   allow that excess: δ_R = :data:`RESHUFFLE_OVERSHOOT`·2·tr Σ/(N − 1), tr Σ at its interval's high end
   (:func:`reshuffle_excess`), lowers ‖G‖²'s low end, and B_simple's high end is Fieller's at ‖G‖² − δ_R (rule 8),
   so that B_simple, its reliability and the advice read from it are the full data's. The band's decisions
   (in the band, shown out of it: rule 7's band windows) stay on the gradient the epoch's steps follow, which the
   estimate measures without bias: whether those steps are mostly noise is a question about them.

7. Drift. Each source keeps a ladder of EMAs: its ``beta`` (≈ 99 effective measurements at 0.98, decaying per
   measurement, whatever the cadence) and the shorter :data:`LADDER` (0.95, 0.8: ≈ 39 and 9). A long window lags
   a quantity that moves: ‖G‖² halving every 50 measurements sits at about 3× its value in an EMA of decay
   0.98, outside the window's own sampling interval (issue #24: 2× on an LM, 10–24× on a LayerNorm MLP). Each
   window's lag is estimated from its difference with the next shorter one: on a linear trend of slope r an EMA
   whose weights have mean age A lags by r·A, so the lag is (x_a − x_b)·A_a/(A_a − A_b) (:func:`mean_age`), the
   difference first lessened by :data:`LAG_NOISE` of its own sampling variance. Each quantity, ‖G‖² and tr Σ
   alike, takes the window of least variance + lag², and that sum is its stated variance: the lag is part of
   the error, so the interval covers the truth also while it moves (tests/noise/test_intervals.py: ‖G‖² halving
   every 50 steps, covered in ≥ 80 % of runs over steps 100–300, ≥ 70 % at each; 85–95 % stationary). The
   covariance of two windows' means is the per-step covariance times Σ_k w_a,k·w_b,k
   (:func:`~trainvitals.noise.estimators.window_overlap`). Each source chooses for itself: attaching a source
   (the stopper's micro-batches) changes the estimate only by its weight (rule 2), and sources measured at
   different cadences are compared (rule 5) each on windows whose lag is in their error. The noise band's ‖G‖² is
   the band window's (``NoiseEstimate.band_grad_sq_norm``; :func:`band_window`: the longest spanning no more
   optimizer steps than the slow decay does at one update a step — the slow window itself for a source measured
   every step, the 0.8 rung for a probe every 10 steps), its tr Σ the chosen one: neither a short
   window's dip nor its lead on a falling ‖G‖² enters the band before that window would (on
   stopping_tasks' digits MLP, following ‖G‖² with short windows stopped runs at steps 130–210, far from
   converged); a lag can only delay a band stop, never advance one. The per-step band, the logged tags and the
   charts read the same choice. That the run *was* out of the band is read from the band windows' ‖G‖² with
   their sampling errors alone, over the edge of the chosen tr Σ with its error (``NoiseEstimate.window_band_ratio_low``
   and ``_high``, the interval the band ratio is logged with: it holds the decision's point): a lagging EMA is
   an unbiased mean of the stretch it spans, so a mean beyond the band's edge shows a step of that stretch out
   of it, where the current value's lag-widened interval could not yet tell.
   ``effective_measurements`` is 1/Σ w_k² of the shorter of the two windows, weighted over the sources as tr Σ
   is: at most the most-measured source's count (:attr:`NoiseEstimate.count`).

8. Intervals. Every quantity carries a 90 % interval from its own error: ‖G‖² ± t·σ_G and tr Σ ± t·σ_S (t
   Student's quantile at n_eff − 1 degrees of freedom, so that few measurements widen it; the low ends
   clamped at 0, which loses no coverage), and B_simple's by Fieller's method (Fieller 1954) on the pair
   (tr Σ, ‖G‖²) with their covariance (rule 3's combination, the sources' correlation weighted as their errors):
   the θ ≥ 0 with (S − θG)² ≤ t²(σ_S² − 2θ·Cov + θ²σ_G²). Where ‖G‖² is within its error of 0, the set is
   unbounded above, and the interval one-sided: B_simple ≥ low, still news (docs/science.md §3c). The band
   ratio's interval is B/B_simple's, the same set inverted. Under reshuffling the three carry rule 6's δ_R; the band
   windows' interval (the decision's) does not. Calibrated on a closed form over 600 seeds
   (tests/noise/test_intervals.py): each covers the truth in 85–95 % of runs, with ‖G‖² near 0 too. Where rule 6's
   δ_R, not ‖G‖²'s own error, takes B_simple's upper end away, the words say so (:func:`epoch_order_cause`).

9. A fixed epoch order. Where every epoch draws the same K batches in the same order (``shuffle=False``:
   :attr:`NoiseSource.distinct_batches`, K/gcd(K, m) for a source measuring every m of an epoch's K optimizer
   steps), a window of ≈ 99 measurements revisits each batch, whose deviation from the full data repeats: over a
   whole partition the per-step estimates average to ‖G‖² + (N − 1)/N·(S − W) exactly (W the batches' mean S_est),
   an error that no number of epochs shrinks. Each window's sampling variance is taken over min(n_eff, K)
   measurements (spread/(min(n_eff, K) − 1)), and n_eff and Student's t follow. The examples such an epoch never
   draws (:attr:`NoiseSource.left_out`: ``drop_last``'s remainder) move the drawn mean off the full data's; as a
   random r of the N they add at most 4‖G‖²·tr Σ·r/((N − r)(N − 1)) to ‖G‖²'s variance (:func:`left_out_variance`),
   the band windows excepted, as they take no δ_R. Calibrated on a closed form over 400 seeds
   (tests/noise/test_fixed_order.py): 91–97 % coverage, tr Σ's 100 % (the cap is conservative), against 58–62 %
   uncapped; docs/science.md, "In a fixed order".

Consecutive steps are treated as independent; while the run moves, each error holds the chosen window's estimated
lag beside its sampling error (rule 7). Everything stays on the
device; the host reads values only through :meth:`GradientNoise.host_summary` and
:meth:`GradientNoise.disagreement` (one transfer each), on logging steps.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from trainvitals.noise.estimators import (
    BiasCorrectedEMA,
    NoiseScaleEMA,
    NoiseScaleError,
    effective_count,
    fieller_interval,
    mean_covariance,
    stacked_values,
    t_quantile,
    update_together,
    window_overlap,
)

Z90 = 1.6448536269514722
"""Half-width of a two-sided 90% normal interval, in standard errors."""
DEFAULT_MIN_COVERAGE = 0.9
DEFAULT_MAX_REL_ERR = 0.5
MAX_UNMEASURED_TRACE = 0.1
"""Bound on the unmeasured parameters' tr(Σ), as a share of the measured tr(Σ), for a decisive estimate."""
WEIGHTS_REFRESH = 50
"""The per-step band reuses the inverse-variance weights of a full estimate at most this many calls old."""
AGREEMENT_Z = 3.0
"""Two sources disagree when their estimates differ by more than this many combined standard errors (as a normal
quantile: Student's t at the fewer effective measurements of the two, rule 8): the check runs at every logging
step, so a single test's 2 would raise false alarms over a long run."""
COUPLING_Z = 5.5
"""A per-example source's ‖G‖² on its band window this many standard errors below zero (as a normal quantile:
Student's t at the window's effective measurements) shows coupled examples (rule 5). The test runs at every logging
step and a skewed per-step estimate has a heavy lower tail: at ‖G‖² = 0 with one-dimensional noise, checked at
every step, 3 dropped 47 % of runs in 1000 steps; 5.5 drops 0.7 % in 3000 (0 % with ten-dimensional noise;
tests/noise/test_coupling.py)."""
MIN_MEASUREMENTS = 20
"""Updates a source needs before its errors are trusted: to be found coupled, and to decide or advise."""
LADDER = (0.95, 0.8)
"""Decays per measurement of each source's shorter windows, below its own ``beta`` (about 39 and 9 effective
measurements; rule 7)."""
LAG_NOISE = 0.15
"""Share of a window difference's own sampling variance taken off its square before the rest counts as lag (rule 7):
at 0 a stationary run's intervals over-cover (95.5 % for a 90 % B_simple interval), at 1 the lag estimate's noise
lets a falling ‖G‖² escape its interval (≈ 70 %); 0.15 keeps both within bounds (tests/noise/test_intervals.py)."""
RESHUFFLE_OVERSHOOT = 2.0
"""Factor on SGD's bound 2·tr Σ/(N − 1) of the epoch-order excess (rule 6): heavy-ball momentum μ answers the
epoch's noise with up to 1/(1 − μ) times the step and overshoots plain SGD's saturation (1.6× at μ = 0.9 on
tests/noise/test_reshuffling.py's quadratic); Adam's measured excess lay within SGD's bound (docs/science.md, "Under
random reshuffling")."""
INDEPENDENT = "micro_batch"
"""The source whose draws are independent by construction (micro-batches and ranks): it decides disagreements."""
EXPECTED_BATCH_NORM = "grad_noise/expected_batch_norm"
"""Tag of the RMS norm the batch gradient is expected to have, sqrt(‖G‖² + tr Σ/B) (:class:`NoiseEstimate`)."""
RESHUFFLE_EXCESS = "grad_noise/reshuffle_excess"
"""Tag of rule 6's δ_R where each epoch reshuffles: what the report needs to name it as the cause of an unbounded
B_simple (:func:`epoch_order_cause`)."""
SOURCES_CHECK = "grad_noise/sources_check"
"""Text tag of what :meth:`GradientNoise.disagreement` said (a source dropped, two that disagree), for the report."""
COUPLING_CAUSES = (
    "batch statistics (BatchNorm, or F.batch_norm in training mode in a custom module) or a loss "
    "coupling the examples (in-batch negatives, as in a contrastive InfoNCE loss)"
)
_VERSIONS = itertools.count()  # NoiseSource.version: unique over all sources, so a new one never matches an old key


class NoiseSource:
    """One source's smoothed ‖G‖² and tr(Σ), their sampling variances, validity and coverage.

    Args:
        name: ``"micro_batch"`` (micro-batches and ranks), ``"probe"`` (BatchVarianceProbe's sources) …
        beta: EMA decay per update, in [0, 1).
        param_share: share of the trainable parameters (by count) it measures, in [0, 1].
        steps_per_update: optimizer steps between two updates (a probe's ``measure_every_n_steps``): what sets
            :attr:`band_window`.

    Attributes:
        ema, error: the EMAs of the estimates and of their second moments, in the source's own units (decay
            ``beta`` per measurement).
        ladder: the same at the shorter decays of :data:`LADDER` below ``beta``, longest first: the windows
            :meth:`smoothed` chooses from, per quantity, where the slow ones lag a moving ‖G‖² or tr(Σ) (rule 7).
        band_window: the index, in :attr:`windows`, of the window the noise band reads (:func:`band_window`).
        unit_scale: the factor from the source's gradient units to those of ``.grad`` (host float).
        effective_batch_size: examples per optimizer step, once seen.
        population: N, the training examples each epoch draws without replacement (rule 6), once seen; ``None``
            otherwise. Saved with the source, so that a fit resumed with no step left corrects as the last did.
        reshuffled: whether each epoch draws a new permutation of those N (rule 6's epoch-order excess); saved too.
        distinct_batches: K, the distinct batches the source's measurements revisit where every epoch draws the
            same batches in the same order (``shuffle=False``): at most K of its measurements carry independent
            errors (rule 9); ``None`` otherwise. Saved too.
        left_out: the examples of N that such an epoch never draws (``drop_last``'s remainder, a
            ``limit_train_batches``): the full data's ‖G‖² differs from the drawn examples' by their share (rule 9).
        invalid: why the source does not estimate sampling noise; ``""`` while valid.
        same_as: the name of a source that is the same estimator on the same gradients (a probe measuring every
            parameter from micro-batches, as the stopper's ``micro_batch`` source does): while that one is valid,
            this one stays out of the estimate, which would otherwise count one measurement twice.
        version: changes with every update or restore (what :meth:`GradientNoise.estimate` caches on).
    """

    def __init__(self, name: str, beta: float, param_share: float = 1.0, steps_per_update: int = 1) -> None:
        self.name = name
        self.ema = NoiseScaleEMA(beta)
        self.error = NoiseScaleError(beta)
        self.ladder = [(NoiseScaleEMA(b), NoiseScaleError(b)) for b in LADDER if b < beta]
        self.steps_per_update = steps_per_update
        self.band_window = band_window([ema.beta for ema, _ in self.windows], steps_per_update)
        self._betas = torch.tensor([ema.beta for ema, _ in self.windows], dtype=torch.float64)
        self._betas_on = self._betas  # on the windows' device (choice)
        self._count_table: Tensor | None = None  # count_terms by update count (_count_terms)
        # (version, choice(), the windows' second moments (L, 3, ...) it read): computed once per update.
        self._choice: tuple[int, tuple[Tensor, ...], Tensor] | None = None
        self._norms = BiasCorrectedEMA(beta, (2,))  # of (‖ḡ_covered‖², ‖ḡ‖²)
        self.last_covered_sq_norm: Tensor | None = None  # ‖ḡ‖² of the measured parameters at the last update
        self.param_share = param_share
        self.unit_scale = 1.0
        self.effective_batch_size: int | None = None
        self.population: int | None = None
        self.reshuffled = False
        self.distinct_batches: int | None = None
        self.left_out = 0
        self.invalid = ""
        self.same_as: str | None = None
        self.version = next(_VERSIONS)

    def update(
        self,
        grad_sq_norm: Tensor,
        trace_cov: Tensor,
        valid: Tensor | bool = True,
        covered_sq_norm: Tensor | None = None,
        total_sq_norm: Tensor | None = None,
    ) -> None:
        """One step's ``(‖G‖²_est, S_est)``; with ``covered_sq_norm`` and ``total_sq_norm`` (‖ḡ‖² over the
        measured parameters and over all, any common units) also the share of ‖ḡ‖² it covers. No sync."""
        self.version = next(_VERSIONS)
        g = grad_sq_norm.detach().double()
        s = trace_cov.detach().to(g.device, torch.float64)
        # NoiseScaleEMA.update and NoiseScaleError.update of every window, in one fused update of them all.
        windows = self.windows
        pair, moments = torch.stack([g, s]), torch.stack([s * s, g * g, s * g])
        update_together([(pair, [ema._ema for ema, _ in windows]), (moments, [e._moments for _, e in windows])], valid)
        if covered_sq_norm is not None and total_sq_norm is not None:
            pair = torch.stack(
                [covered_sq_norm.detach().double(), total_sq_norm.detach().to(covered_sq_norm.device).double()]
            )
            self._norms.update(pair, valid)
            self.last_covered_sq_norm = pair[0]

    def read_sampler(self, loader: Any, batches: float | None = None, accumulate: int = 1, world: int = 1) -> None:
        """:attr:`population` and :attr:`reshuffled` from the train loader (rule 6); with ``batches`` (the loader's
        batches an epoch draws, on each of ``world`` ranks, ``accumulate`` to an optimizer step) also
        :attr:`distinct_batches` and :attr:`left_out` (rule 9)."""
        self.population = population_of(loader)
        self.reshuffled = self.population is not None and reshuffles(loader)
        self.distinct_batches, self.left_out = None, 0
        size = getattr(loader, "batch_size", None)
        if self.population is None or self.reshuffled or batches is None or not math.isfinite(batches) or not size:
            return
        steps = math.ceil(batches / accumulate)
        if steps >= 1:
            self.distinct_batches = steps // math.gcd(steps, self.steps_per_update)
            self.left_out = max(0, self.population - int(batches) * size * world)

    def restart(self) -> None:
        """Forget the updates so far (they measured the wrong thing); validity, units and batch size kept."""
        fresh = NoiseSource(self.name, self.ema.beta, steps_per_update=self.steps_per_update).state_dict()
        self.load_state_dict({k: fresh[k] for k in ("noise", "error", "ladder", "norms")})

    @property
    def windows(self) -> list[tuple[NoiseScaleEMA, NoiseScaleError]]:
        """The slow EMAs and the :attr:`ladder`'s, longest first."""
        return [(self.ema, self.error), *self.ladder]

    def choice(self) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """The window of each quantity (rule 7) and what its errors need, no sync: ``(values, per_step, cross, lag_sq,
        chosen, overlap)`` — the L windows' EMA means ``(L, 2, ...)`` of (‖G‖², tr Σ), longest first; the per-step
        variances ``(L, 2, ...)`` and covariance ``(L, ...)`` each window's spread gives; each window's squared lag
        ``(L, 2, ...)``; the chosen window per quantity ``(2, ...)`` (an index); and K_ab = Σ_k w_a,k·w_b,k ``(L, L)``
        of each pair of windows' weights (:func:`~trainvitals.noise.estimators.window_overlap`, 1/n_eff on the
        diagonal).

        The lag: on a linear trend of slope r per measurement an EMA whose weights have mean age A lags by r·A, so a
        window and the next shorter one differ by r·(A_a − A_b), and the window's lag is that difference times
        A_a/(A_a − A_b) (the shortest: none). Each quantity takes the window of the least variance + lag².

        Computed once per update (:attr:`version`) and shared by its readers that step (the per-step band, the full
        estimate, the drift): treat the tensors as read-only."""
        if self._choice is not None and self._choice[0] == self.version:
            return self._choice[1]
        windows = self.windows
        device = self.ema.count.device
        if self._betas_on.device != device:
            self._betas_on = self._betas.to(device)
        values = stacked_values([ema._ema for ema, _ in windows], self._betas_on)  # (L, 2, ...)
        moments = stacked_values([e._moments for _, e in windows], self._betas_on)  # (L, 3, ...) of (S², ‖G‖²², S·‖G‖²)
        count = self.ema.count
        overlap, bessel, scale, spread = self._count_terms(count, values.device)
        ones = [1] * (values.dim() - 2)
        bessel = bessel.reshape(-1, *ones)
        second = torch.stack([moments[:, 1], moments[:, 0]], 1)
        per_step = (second - values.square()).clamp_min(0.0) * bessel.unsqueeze(1)
        per_step = torch.where(count.to(values.device) >= 2, per_step, math.inf)
        cross = (moments[:, 2] - values[:, 0] * values[:, 1]) * bessel
        # The difference's own sampling variance v_b·(K_aa + K_bb − 2K_ab) (b the shorter window), in part taken off.
        spread, scale = spread.reshape(-1, 1, *ones), scale.reshape(-1, 1, *ones)
        excess = ((values[:-1] - values[1:]).square() - LAG_NOISE * per_step[1:] * spread).clamp_min(0.0)
        lag_sq = torch.cat([excess * scale.square(), torch.zeros_like(values[:1])])
        var = per_step * overlap.diagonal().reshape(-1, 1, *ones)
        chosen = (var + lag_sq).argmin(0)  # all infinite (fewer than two updates): the first, the slowest
        self._choice = (self.version, (values, per_step, cross, lag_sq, chosen, overlap), moments)
        return self._choice[1]

    def _count_terms(self, count: Tensor, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """What :meth:`choice` needs that depends on the update count alone (:func:`count_terms`), on ``device``.

        Looked up by ``count`` in a table over 0 … T − 1 (one gather, no sync), T the count from which the slowest
        decay's t·βᵗ is below float64's resolution, so that every later count's terms are the last row's; built once
        per device. At most :data:`COUNT_TABLE_ROWS` rows (the default windows: 2,665 rows of 16 numbers, 0.34 MB); a
        slower decay, whose table would be longer, computes them at each call instead."""
        if self._count_table is None or self._count_table.device != device:
            rows = table_rows(float(self._betas.max()))
            self._count_table = None if rows is None else count_terms(self._betas, torch.arange(rows)).to(device)
        table = self._count_table
        if table is None:
            row = count_terms(self._betas.to(count.device), count.reshape(1))[0]
        else:
            row = table.index_select(0, count.reshape(1).to(device).clamp_max(len(table) - 1))[0]
        return unpack_count_terms(row.to(device), len(self._betas))

    def smoothed(self) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """``(‖G‖², tr Σ, Var ‖G‖², Var tr Σ, Cov, n_eff)`` of the EMA means the estimate uses, in the source's
        units, each from the window :meth:`choice` takes for it (rule 7): its variance the window's sampling variance
        plus its squared lag; n_eff that of the shorter of the two windows. ``()`` float64 each (or the shape the
        EMAs hold), no sync."""
        values, per_step, cross, lag_sq, chosen, overlap = self.choice()
        g, t = _pick(values, chosen).unbind()  # both quantities in one gather, each from its window
        own = overlap.diagonal()[chosen]  # K_aa = 1/n_eff of each one's window
        widen = self._revisits(1.0 / own.clamp_min(1e-300))
        var_g, var_s = (_pick(per_step, chosen) * own * widen + _pick(lag_sq, chosen)).unbind()
        g_i, s_i = chosen.unbind()
        # Cov of two windows' means: the per-step covariance (the shorter window's) times their weights' overlap.
        cross = _pick(cross, torch.maximum(g_i, s_i)) * overlap[g_i, s_i] * widen.prod(0).sqrt()
        cov = torch.where(torch.isfinite(var_g * var_s), cross, 0.0)
        n_eff = self._distinct(1.0 / torch.maximum(*own.unbind()).clamp_min(1e-300))
        return g, t, var_g, var_s, cov, torch.where(self.ema.count.to(n_eff.device) > 0, n_eff, 0.0)

    def _distinct(self, n_eff: Tensor) -> Tensor:
        """``n_eff`` capped at :attr:`distinct_batches` (rule 9): a fixed epoch order repeats its K batches, and
        their errors with them."""
        return n_eff if self.distinct_batches is None else n_eff.clamp_max(float(self.distinct_batches))

    def _revisits(self, n_eff: Tensor) -> Tensor:
        """(n − 1)/(n_K − 1), n_K = min(n, K), per window of ``n_eff`` = n measurements (rule 9): the factor from a
        window mean's variance over n independent measurements, spread/(n − 1), to that over the K distinct batches
        a fixed epoch order revisits, spread/(n_K − 1); 1 where the order is not fixed or n ≤ K."""
        capped = self._distinct(n_eff)
        return torch.where(capped < n_eff, (n_eff - 1) / (capped - 1).clamp_min(1e-300), torch.ones_like(n_eff))

    def slow_moments(self) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """:meth:`smoothed`'s tuple for the :attr:`band_window` alone, with its sampling error only (no lag): an
        unbiased estimate of the run's weighted mean over that window, what it says of the past (rule 7)."""
        values = self.choice()[0][self.band_window]
        moments = self._choice[2][self.band_window]  # type: ignore[index]  # set by choice()
        ema, error = self.windows[self.band_window]
        # NoiseScaleError.mean_covariance on the EMAs choice() has read; n_eff of the error's count and of the EMA's.
        counts = torch.stack([error._moments.count, ema.count])
        n_eff = self._distinct(effective_count(ema.beta, counts))  # rule 9: a fixed order's K batches at most
        var_s, var_g, cov = mean_covariance(values, moments, n_eff[0], counts[0])
        g, t = values.unbind()
        return g, t, var_g, var_s, cov, n_eff[1]

    def band_drift(self) -> Tensor:
        """``(3, ...)``: the :attr:`band_window`'s mean age in optimizer steps (:func:`mean_age` times
        ``steps_per_update``) and the drift per optimizer step of (‖G‖², tr Σ) that its estimated lag gives,
        |lag|/age (source units; 0 where the lag is not resolved): what two sources' band windows that span
        different stretches of the run differ by from drift alone (rule 5). No sync."""
        _, _, _, lag_sq, _, _ = self.choice()
        age = mean_age(self._betas.to(lag_sq.device), self.ema.count.to(lag_sq.device))[self.band_window]
        age = age * self.steps_per_update
        drift = lag_sq[self.band_window].sqrt() / age.clamp_min(1e-300)
        return torch.cat([age.expand_as(drift[:1]), torch.where(age > 0, drift, 0.0)])

    def band_values(self) -> Tensor:
        """``(3,)`` (‖G‖², tr Σ, the ‖G‖² the band is judged on) of :meth:`smoothed`, in fewer kernels (the per-step
        band's). The band's ‖G‖² is the :attr:`band_window`'s (rule 7): neither a short window's dip nor its lead on
        a falling ‖G‖² enters the band before that window would (a maximum over windows would be biased up where
        they only scatter)."""
        values, _, _, _, chosen, _ = self.choice()
        return torch.cat([_pick(values, chosen), values[self.band_window, :1]])

    def invalidate(self, reason: str) -> None:
        """Mark the source as not estimating sampling noise (kept for the rest of the fit)."""
        self.invalid = self.invalid or reason

    @property
    def norm_share(self) -> Tensor:
        """``()`` share of ‖ḡ‖² over the measured parameters (EMA of both); 1 when it was never told."""
        covered, total = self._norms.value.unbind()
        told = self._norms.count > 0
        return torch.where(told, (covered / total.clamp_min(1e-300)).clamp(0.0, 1.0), torch.ones_like(covered))

    def state_dict(self) -> dict[str, Any]:
        return {
            "noise": self.ema.state_dict(),
            "error": self.error.state_dict(),
            "ladder": [{"noise": ema.state_dict(), "error": error.state_dict()} for ema, error in self.ladder],
            "norms": self._norms.state_dict(),
            "effective_batch_size": self.effective_batch_size,
            "unit_scale": self.unit_scale,
            "population": self.population,
            "reshuffled": self.reshuffled,
            "distinct_batches": self.distinct_batches,
            "left_out": self.left_out,
            "invalid": self.invalid,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.version = next(_VERSIONS)
        self.ema.load_state_dict(state.get("noise", {}))
        self.error.load_state_dict(state.get("error", {}))
        for (ema, error), saved in zip(self.ladder, state.get("ladder", [])):
            ema.load_state_dict(saved.get("noise", {}))
            error.load_state_dict(saved.get("error", {}))
        if "norms" in state:
            self._norms.load_state_dict(state["norms"])
        self.effective_batch_size = state.get("effective_batch_size", self.effective_batch_size)
        self.unit_scale = float(state.get("unit_scale", self.unit_scale))
        self.population = state.get("population", self.population)
        self.reshuffled = bool(state.get("reshuffled", self.reshuffled))
        self.distinct_batches = state.get("distinct_batches", self.distinct_batches)
        self.left_out = int(state.get("left_out", self.left_out))
        self.invalid = str(state.get("invalid", self.invalid))


@dataclass
class NoiseEstimate:
    """The run's combined estimate, ``()`` float64 tensors on the device, in ``.grad`` units.

    ``*_se`` are standard errors (``inf`` before two updates); ``b_simple`` is ``inf`` while ‖G‖² ≤ 0, and its
    relative error (module docstring, rule 4) ``inf`` while its Fieller interval has no upper end.
    ``coverage`` is the share of ‖ḡ‖² measured, ``param_share`` that of the parameters (host float);
    ``unmeasured_trace_share`` bounds the unmeasured parameters' tr(Σ) as a share of the measured one
    (module docstring, rule 4; 0 when all are measured);
    ``measured_norm`` is ‖ḡ‖ over the measured parameters at the last measurement, the norm to set the
    noise level against when they are not all (``None`` when they are).
    ``noise_floor`` is the noise level sqrt(tr Σ/B): the RMS norm a batch gradient of pure noise (G = 0) would
    have, not a lower bound of the observed norm; ``expected_norm`` is the RMS norm E‖ḡ_B‖² = ‖G‖² + tr Σ/B
    (McCandlish et al. 2018, Eq. A.1; drawn without replacement from N, tr Σ/B shrinks by (N − B)/(N − 1)),
    what the batch gradient's norm is expected to be: with one micro-batch source it is exactly the EMA of the
    observed ‖ḡ‖² (the estimators' ‖G‖² + S/B is ‖ḡ_B‖² at every step).
    """

    grad_sq_norm: Tensor
    grad_sq_norm_se: Tensor
    trace_cov: Tensor
    trace_cov_se: Tensor
    b_simple: Tensor
    b_simple_rel_err: Tensor
    noise_floor: Tensor
    noise_floor_se: Tensor
    expected_norm: Tensor
    coverage: Tensor
    unmeasured_trace_share: Tensor
    count: Tensor
    measured_norm: Tensor | None
    param_share: float
    batch_size: int | None
    sources: tuple[str, ...]
    intervals: dict[str, tuple[Tensor, Tensor]]
    """90% intervals (rule 8): ``"grad_sq_norm"``, ``"trace_cov"``, ``"b_simple"`` (its high end ``inf`` where
    ‖G‖² is within its error of 0) and ``"band_ratio"`` (over B/B_simple, the ratio at margin 1; divide by the
    margin), each ``(low, high)``."""
    effective_measurements: Tensor
    """The effective number of measurements 1/Σ w_k² behind the estimate (rule 7), ``()`` float64."""
    band_grad_sq_norm: Tensor
    """The ‖G‖² the noise band is judged on (rule 7): each source's band window's, combined as ``grad_sq_norm``
    is; what the stopper's band charts draw."""
    window_band_ratio_low: Tensor
    """The 90 % lower end of B/B_simple over the band windows with their sampling errors alone (rule 7): the
    run's weighted mean over them; above the margin, the run was out of the band at some step of that stretch."""
    window_band_ratio_high: Tensor
    """Its 90 % upper end (``inf`` where the band windows' ‖G‖² is within its error of 0): with the low end, the
    interval of the ratio the band is judged on (``band_grad_sq_norm``), as the stopper logs it."""


class GradientNoise:
    """The run's one gradient-noise estimate, fed by every source present (module docstring).

    Callbacks share one instance per fit (``vitals.shared(GRADIENT_NOISE, GradientNoise)``,
    :mod:`trainvitals.plumbing.sharing`); each owns, resets and saves its own :class:`NoiseSource`
    and attaches it here.

    :attr:`population` is the number N of training examples when each epoch draws them without
    replacement (a shuffled or sequential DataLoader, a DistributedSampler), as its sources saw it; ``None``
    otherwise.

    Args:
        min_coverage: share of ‖ḡ‖² the estimate must cover to be decisive, in (0, 1].
        max_rel_err: B_simple's relative standard error above which no noise-aware advice is given (> 0).
    """

    def __init__(self, min_coverage: float = DEFAULT_MIN_COVERAGE, max_rel_err: float = DEFAULT_MAX_REL_ERR) -> None:
        if not 0 < min_coverage <= 1:
            raise ValueError(f"`min_coverage` must be in (0, 1], got {min_coverage}")
        if not max_rel_err > 0:
            raise ValueError(f"`max_rel_err` must be > 0, got {max_rel_err}")
        self.min_coverage = min_coverage
        self.max_rel_err = max_rel_err
        self.sources: dict[str, NoiseSource] = {}
        self._said_disagreement = False
        # The last full estimate's weights and coverage, for the per-step band (see in_noise_band).
        self._cached: tuple[tuple[int, ...], Tensor, Tensor, Tensor, Tensor] | None = None
        self._stale = 0  # band calls since that estimate
        self._last: tuple[tuple[Any, ...], NoiseEstimate] | None = None  # that estimate, and what it was made of
        self.band_decisive: Tensor | None = None  # whether the last in_noise_band call could decide (device)

    def attach(self, source: NoiseSource) -> None:
        """Feed the estimate from ``source`` (replacing one of the same name: a new fit's fresh source,
        which also lets a disagreement be said again)."""
        if self.sources.get(source.name) is not source:
            self._said_disagreement = False
        self.sources[source.name] = source

    def detach(self, name: str) -> None:
        self.sources.pop(name, None)

    @property
    def population(self) -> int | None:
        """N, when the examples are drawn without replacement (rule 6): the sources' (they see the same data)."""
        return next((s.population for s in self.sources.values() if s.population is not None), None)

    @property
    def reshuffled(self) -> bool:
        """Whether each epoch reshuffles the :attr:`population` (rule 6's epoch-order excess): the sources'."""
        return self.population is not None and any(s.reshuffled for s in self.sources.values())

    @property
    def left_out(self) -> int:
        """The examples of :attr:`population` a fixed epoch order never draws (rule 9): the sources' largest."""
        return max((s.left_out for s in self.sources.values() if s.population is not None), default=0)

    def valid_sources(self) -> list[NoiseSource]:
        """The valid sources over the largest share of the parameters, each estimator once (host only, no sync)."""
        valid = [s for s in self.sources.values() if not s.invalid and not self.shadowed(s)]
        if not valid:
            return []
        widest = max(s.param_share for s in valid)
        return [s for s in valid if s.param_share >= widest - 1e-9]

    def shadowed(self, source: NoiseSource) -> bool:
        """Whether ``source`` repeats another valid source's estimator (:attr:`NoiseSource.same_as`)."""
        same = self.sources.get(source.same_as) if source.same_as else None
        return same is not None and same is not source and not same.invalid

    def invalid_reasons(self) -> list[str]:
        return [f"the {s.name} source is invalid: {s.invalid}" for s in self.sources.values() if s.invalid]

    def estimate(self, device: torch.device | None = None) -> NoiseEstimate:
        """The combination of :meth:`valid_sources` (module docstring, rule 2–3); zeros, ``inf`` errors and a
        count of 0 (on ``device``, default CPU: no copy) when there is none.

        Cached: until a source is updated, restored or reconfigured, a call returns the last one's object
        (the stopper and the probe both log the estimate at a logging step); treat it as read-only."""
        chosen = self.valid_sources()
        if not chosen:
            zero = torch.zeros((), dtype=torch.float64, device=device)
            inf = torch.full((), float("inf"), dtype=torch.float64, device=device)
            return NoiseEstimate(
                zero,
                inf,
                zero,
                inf,
                inf,
                inf,
                zero,
                inf,
                zero,
                zero,
                inf,
                torch.zeros((), dtype=torch.long, device=device),
                None,
                0.0,
                None,
                (),
                {k: (zero, inf) for k in INTERVALS},
                zero,
                zero,
                zero,
                inf,
            )
        key = (
            tuple((src.version, src.unit_scale, src.effective_batch_size, src.param_share) for src in chosen),
            self.population,
            self.reshuffled,
            tuple(src.distinct_batches for src in chosen),
            self.left_out,
            self.min_coverage,
        )
        if self._last is not None and self._last[0] == key:
            self._stale = 0  # as a fresh estimate would: _cached holds this one's weights
            return self._last[1]
        self._last = (key, self._combine(chosen))
        return self._last[1]

    def _combine(self, chosen: list[NoiseSource]) -> NoiseEstimate:
        device = chosen[0].ema.count.device
        per = []
        for src in chosen:
            per.append((*self._moments(src, device), src.ema.count.to(device), src.norm_share.to(device)))
        g, s, var_g, var_s, cov, n_eff, count, share = (torch.stack(parts) for parts in zip(*per))
        seen = count > 0
        g_w, s_w = _weights(var_g, seen), _weights(var_s, seen)
        band_grad = (g_w * torch.stack([self._band_pair(src, device)[0] for src in chosen])).sum()
        grad = (g_w * g).sum()
        trace = (s_w * s).sum()
        sd_g, sd_s = var_g.sqrt(), var_s.sqrt()
        grad_se = _bound(g_w, sd_g)
        trace_se = _bound(s_w, sd_s)
        sampling_cov = _combined_cov(s_w, g_w, cov, sd_s, sd_g, trace_se, grad_se)
        if self.population is not None and self.left_out:  # rule 9: the examples a fixed order never draws
            grad_se = (grad_se.square() + left_out_variance(grad, trace, self.population, self.left_out)).sqrt()
        b_simple = torch.where(grad > 0, trace / grad.clamp_min(1e-300), torch.full_like(grad, float("inf")))
        batch = next((src.effective_batch_size for src in chosen if src.effective_batch_size), None)
        measurements = (s_w * n_eff).sum()
        intervals = noise_intervals(
            grad,
            trace,
            grad_se,
            trace_se,
            sampling_cov,
            measurements,
            batch,
            self.population if self.reshuffled else None,
        )
        rel_err = fieller_rel_err(b_simple, *intervals["b_simple"], measurements)
        # The band's ‖G‖² (the band windows', weighted as grad is) with those windows' sampling errors alone: the
        # run's weighted mean over them, for "was out" (rule 7), over the band's edge of the chosen tr Σ, as the
        # decision reads it, so that the ratio the stopper logs lies in this interval (Fieller's set holds its point).
        past = [self._moments(src, device, slow=True) for src in chosen]
        _, _, pvg, _, pcov, pn = (torch.stack(parts) for parts in zip(*past))
        band_sd = pvg.sqrt()
        band_se = _bound(g_w, band_sd)
        window_band_low, window_band_high = noise_intervals(
            band_grad,
            trace,
            band_se,
            trace_se,
            _combined_cov(s_w, g_w, pcov, sd_s, band_sd, trace_se, band_se),
            torch.minimum(measurements, (g_w * pn).sum()),
            batch,
        )["band_ratio"]
        floor = torch.sqrt(trace.clamp_min(0.0) / (batch or 1))
        floor_se = torch.where(
            trace > 0, floor * trace_se / (2 * trace.clamp_min(1e-300)), torch.full_like(floor, float("inf"))
        )
        coverage = torch.where(seen, share, 0.0).max()
        # Rule 4: the unmeasured tr Σ ≤ B·u·‖ḡ‖²/f, over the measured tr Σ; B·‖G‖²/tr Σ = B/B_simple; f = (N − B)/(N − 1)
        # drawing B of N without replacement (rule 6), 1 with replacement (a full batch, f = 0, bounds nothing).
        kept = 1.0 if self.population is None or not batch else (self.population - batch) / max(self.population - 1, 1)
        expected = torch.sqrt((grad + kept * trace.clamp_min(0.0) / (batch or 1)).clamp_min(0.0))
        signal = torch.where(
            (trace > 0) & (kept > 0),
            (batch or math.inf) * grad.clamp_min(0.0) / trace.clamp_min(1e-300) / max(kept, 1e-300),
            torch.full_like(trace, float("inf")),
        )
        unmeasured = torch.where(
            coverage >= 1.0, torch.zeros_like(coverage), (1.0 - coverage) / coverage.clamp_min(1e-300) * (1.0 + signal)
        )
        covers = (coverage >= self.min_coverage) & (unmeasured <= MAX_UNMEASURED_TRACE)
        self._cached, self._stale = (tuple(id(src) for src in chosen), g_w, s_w, covers, grad_se), 0
        param_share = min(src.param_share for src in chosen)
        last = chosen[0].last_covered_sq_norm
        measured = last.to(device).sqrt() * chosen[0].unit_scale if param_share < 1 and last is not None else None
        return NoiseEstimate(
            grad,
            grad_se,
            trace,
            trace_se,
            b_simple,
            rel_err,
            floor,
            floor_se,
            expected,
            coverage,
            unmeasured,
            count.max(),
            measured,
            param_share,
            batch,
            tuple(src.name for src in chosen),
            intervals,
            measurements,
            band_grad,
            window_band_low,
            window_band_high,
        )

    def _moments(self, src: NoiseSource, device: torch.device, slow: bool = False) -> tuple[Tensor, ...]:
        """``src``'s (‖G‖², tr Σ, Var ‖G‖², Var tr Σ, Cov, n_eff) in ``.grad`` units (:meth:`NoiseSource.smoothed`,
        its own windows; with ``slow`` :meth:`NoiseSource.slow_moments`), with the finite-population correction
        (module docstring, rule 6) when :attr:`population` is known."""
        u2 = src.unit_scale**2
        g, t, var_g, var_s, cov, n_eff = (v.to(device) for v in (src.slow_moments() if slow else src.smoothed()))
        if u2 != 1.0:  # (the micro-batches' are in .grad units already)
            g, t, var_g, var_s, cov = g * u2, t * u2, var_g * u2**2, var_s * u2**2, cov * u2**2
        if self.population is None:
            return g, t, var_g, var_s, cov, n_eff
        n, c = self.population, (self.population - 1) / self.population
        return (
            *finite_population(g, t, n),
            var_g + 2 * cov / n + var_s / n**2,
            var_s * c**2,
            c * (cov + var_s / n),
            n_eff,
        )

    def _band_pair(self, src: NoiseSource, device: torch.device) -> Tensor:
        """``(2,)`` (the band's ‖G‖², tr Σ) of ``src`` (:meth:`NoiseSource.band_values`) in ``.grad`` units, corrected
        for a known population as :meth:`_moments` corrects (rule 6)."""
        u2 = src.unit_scale**2
        values = src.band_values().to(device)
        _, t, g = (values if u2 == 1.0 else values * u2).unbind()
        if self.population is not None:
            g, t = finite_population(g, t, self.population)
        return torch.stack([g, t])

    def decisive(self, estimate: NoiseEstimate | None = None) -> Tensor:
        """``()`` bool: a measured estimate covering enough of the model (module docstring, rule 4; no sync)."""
        est = estimate or self.estimate()
        return (est.count >= MIN_MEASUREMENTS) & self._covers(est)

    def reliable(self, estimate: NoiseEstimate | None = None) -> Tensor:
        """``()`` bool: decisive, ‖G‖² > 0 and B_simple's relative error ≤ ``max_rel_err`` (no sync)."""
        est = estimate or self.estimate()
        return self.decisive(est) & (est.grad_sq_norm > 0) & (est.b_simple_rel_err <= self.max_rel_err)

    def _covers(self, est: NoiseEstimate) -> Tensor:
        return (est.coverage >= self.min_coverage) & (est.unmeasured_trace_share <= MAX_UNMEASURED_TRACE)

    def in_noise_band(
        self, margin: float, estimate: NoiseEstimate | None = None, device: torch.device | None = None
    ) -> Tensor:
        """``()`` bool: ‖G‖² ≤ margin · tr(Σ)/B on a decisive estimate. A negative ‖G‖² from valid
        sources within its error counts (G ≈ 0); no valid source, fewer than :data:`MIN_MEASUREMENTS`
        or partial coverage never does.

        Without ``estimate`` (the stopper, every step) the sources' current EMAs are combined with the
        weights and coverage of the last full :meth:`estimate` (taken on logging steps, and at least
        every :data:`WEIGHTS_REFRESH` calls or when the valid sources changed): a few kernels a step
        instead of some two hundred. The weights only set how the sources are mixed, so a stale one
        leaves the estimate unbiased."""
        if estimate is not None:
            est = estimate
            return self._band(
                margin,
                est.band_grad_sq_norm,
                est.trace_cov,
                est.count,
                self._covers(est),
                est.batch_size,
                est.grad_sq_norm_se,
            )
        chosen = self.valid_sources()
        if not chosen:
            return torch.zeros((), dtype=torch.bool, device=device)
        self._stale += 1
        if self._cached is None or self._cached[0] != tuple(id(src) for src in chosen) or self._stale > WEIGHTS_REFRESH:
            est = self.estimate()
            return self._band(
                margin,
                est.band_grad_sq_norm,
                est.trace_cov,
                est.count,
                self._covers(est),
                est.batch_size,
                est.grad_sq_norm_se,
            )
        _, g_w, s_w, covers, grad_se = self._cached
        first = chosen[0].ema.count.device
        pairs = torch.stack([self._band_pair(src, first) for src in chosen])
        counts = torch.stack([src.ema.count.to(first) for src in chosen])
        batch = next((src.effective_batch_size for src in chosen if src.effective_batch_size), None)
        return self._band(
            margin, (g_w * pairs[:, 0]).sum(), (s_w * pairs[:, 1]).sum(), counts.max(), covers, batch, grad_se
        )

    def _band(
        self,
        margin: float,
        grad: Tensor,
        trace: Tensor,
        count: Tensor,
        covers: Tensor,
        batch: int | None,
        grad_se: Tensor,
    ) -> Tensor:
        if batch is None:
            return torch.zeros((), dtype=torch.bool, device=count.device)
        uncoupled = grad >= -COUPLING_Z * grad_se.to(grad.device)  # below zero beyond its error: coupled (rule 5)
        self.band_decisive = (count >= MIN_MEASUREMENTS) & covers.to(count.device)
        return self.band_decisive & (trace > 0) & uncoupled & (grad <= margin * trace / batch)

    def metrics(self, estimate: NoiseEstimate | None = None) -> dict[str, Tensor]:
        """The run's one noise level (``grad_norm/noise_floor``), the batch-gradient norm it expects
        (``grad_noise/expected_batch_norm``, beside ``grad_norm/total``) and one B_simple, with their errors and
        the coverage, as tags (device), and for a partly measured model ``grad_norm/measured_total``, the norm of
        the parameters they cover,
        and ``grad_noise/unmeasured_trace_share``, the bound on the tr(Σ) it cannot see (rule 4);
        ``grad_noise/b_simple_unreliable`` is 1 where no noise-aware advice follows (not decisive, ‖G‖² ≤ 0,
        or a relative error above ``max_rel_err``); the 90% intervals ``grad_noise/<quantity>_low`` and ``_high``
        of ``b_simple``, ``grad_sq_norm`` and ``trace_cov`` (rule 8; an infinite high end is left out by the
        writers: TensorBoard would scale the chart to it), ``grad_noise/effective_measurements`` (rule 7) and, where
        each epoch reshuffles, ``grad_noise/reshuffle_excess``, the δ_R the full-data intervals allow (rule 6)."""
        est = estimate or self.estimate()
        reliable = self.reliable(est)
        intervals = {
            f"grad_noise/{name}_{end}": value
            for name in ("b_simple", "grad_sq_norm", "trace_cov")
            for end, value in zip(("low", "high"), est.intervals[name])
        }
        measured = (
            {}
            if est.measured_norm is None
            else {
                "grad_norm/measured_total": est.measured_norm,
                "grad_noise/unmeasured_trace_share": est.unmeasured_trace_share,
            }
        )
        population = self.population
        excess = (
            {RESHUFFLE_EXCESS: reshuffle_excess(est.intervals["trace_cov"][1], population)}
            if self.reshuffled and population is not None
            else {}
        )
        return {
            **measured,
            **excess,
            "grad_norm/noise_floor": est.noise_floor,
            "grad_noise/b_simple_unreliable": (~reliable).double(),
            "grad_norm/noise_floor_se": est.noise_floor_se,
            EXPECTED_BATCH_NORM: est.expected_norm,
            "grad_noise/b_simple": est.b_simple,
            "grad_noise/b_simple_rel_err": est.b_simple_rel_err,
            "grad_noise/trace_cov": est.trace_cov,
            "grad_noise/trace_cov_se": est.trace_cov_se,
            "grad_noise/grad_sq_norm": est.grad_sq_norm,
            "grad_noise/grad_sq_norm_se": est.grad_sq_norm_se,
            "grad_noise/coverage": est.coverage,
            **intervals,
            "grad_noise/effective_measurements": est.effective_measurements,
        }

    def latest(self) -> NoiseEstimate:
        """The last :meth:`estimate` computed, while its valid sources are still the ones; else a new one. For a
        reader between steps (the lr advisor, before a step) that needs no fresher estimate than the one the
        others logged: no second estimate per logging step."""
        chosen = tuple(id(src) for src in self.valid_sources())
        if self._last is not None and self._cached is not None and self._cached[0] == chosen:
            return self._last[1]
        return self.estimate()

    def host_summary(self, estimate: NoiseEstimate | None = None) -> dict[str, Any]:
        """The estimate (default: :meth:`estimate`) as host floats (one transfer), with ``decisive`` and
        ``reliable`` flags and ``why`` a sentence when it is not both."""
        est = estimate or self.estimate()
        keys = (
            "grad_sq_norm",
            "grad_sq_norm_se",
            "trace_cov",
            "trace_cov_se",
            "b_simple",
            "b_simple_rel_err",
            "noise_floor",
            "noise_floor_se",
            "expected_norm",
            "coverage",
            "unmeasured_trace_share",
            "count",
            "effective_measurements",
            "band_grad_sq_norm",
        )
        ends = [f"{name}_{end}" for name in INTERVALS for end in ("low", "high")]
        device = est.count.device
        flags = [self.decisive(est), self.reliable(est)]  # the device's own tests, read in the same transfer
        values = (
            torch.stack(
                [getattr(est, k).double().reshape(()).to(device) for k in keys]
                + [v.double().reshape(()).to(device) for name in INTERVALS for v in est.intervals[name]]
                + [f.to(device, torch.float64) for f in flags]
            )
            .cpu()
            .tolist()
        )
        out: dict[str, Any] = dict(zip(keys + tuple(ends), values))
        out.update(param_share=est.param_share, batch_size=est.batch_size, sources=est.sources)
        out["decisive"], out["reliable"] = (bool(v) for v in values[len(keys) + len(ends) :])
        out["why"] = self.why_not(out)
        return out

    def why_not(self, summary: dict[str, Any]) -> str:
        """Why the estimate cannot decide or advise, as one sentence; ``""`` when it can."""
        if not self.sources:
            return "no noise source"
        if not self.valid_sources():
            return "; ".join(["no valid noise source", *self.invalid_reasons()])
        if summary["count"] == 0:
            return "not measured yet"
        if summary["coverage"] < self.min_coverage:
            return (
                f"partial: the estimate covers {summary['coverage']:.0%} of ‖ḡ‖² and "
                f"{summary['param_share']:.0%} of the parameters, below the {self.min_coverage:.0%} of ‖ḡ‖² it needs"
            )
        if not summary["unmeasured_trace_share"] <= MAX_UNMEASURED_TRACE:
            return (
                f"partial: the estimate covers {summary['coverage']:.0%} of ‖ḡ‖² and "
                f"{summary['param_share']:.0%} of the parameters, but the unmeasured parameters may hold up to "
                f"{summary['unmeasured_trace_share']:.2g}× the measured tr(Σ), above {MAX_UNMEASURED_TRACE:g}: "
                "their share of ‖ḡ‖² bounds their tr(Σ) only by B·(1 − coverage)·‖ḡ‖²"
            )
        if summary["count"] < MIN_MEASUREMENTS:
            return (
                f"not measured enough yet: {summary['count']:.0f} of the {MIN_MEASUREMENTS} measurements its errors "
                "need to be trusted"
            )
        if summary["effective_measurements"] < 2:  # a window of one (a fixed epoch order of one batch): no spread
            return (
                f"B_simple unreliable: {summary['effective_measurements']:.3g} effective measurement, which gives no "
                "error estimate (a fixed epoch order of one batch repeats the same one); "
                f"{b_simple_interval(summary)}"
            )
        rel = summary["b_simple_rel_err"]
        if not rel <= self.max_rel_err:
            interval = b_simple_interval(summary)
            if math.isfinite(rel):
                what = f"its relative error {rel:.2g} is above the bound {self.max_rel_err:g}"
            elif summary["grad_sq_norm"] <= 0:
                what = "the smoothed ‖G‖² is ≤ 0: the gradient's signal is lost in its noise"
            elif math.isfinite(summary["b_simple_high"]):
                what = "the smoothed tr(Σ) is ≤ 0: no noise measured"
            elif not summary["b_simple_low"] > 0:  # Fieller's set holds 0 too: tr(Σ) is within its error of zero
                return (
                    "B_simple unreliable: the smoothed ‖G‖² and tr(Σ) are both within their errors of zero, so "
                    "B_simple has no bound yet"
                )
            else:
                what = self._epoch_order_cause(summary) or (
                    "the smoothed ‖G‖², the gradient's signal, is within its error of zero, so B_simple has no upper "
                    "bound"
                )
            return f"B_simple unreliable: {what}; {interval}"
        return ""

    def _epoch_order_cause(self, summary: dict[str, Any]) -> str:
        """:func:`epoch_order_cause` of a :meth:`host_summary`: ``""`` where the epochs do not reshuffle."""
        if not self.reshuffled or self.population is None or not math.isfinite(summary["trace_cov_high"]):
            return ""
        return epoch_order_cause(
            summary["grad_sq_norm"],
            summary["grad_sq_norm_se"],
            summary["trace_cov"],
            summary["trace_cov_high"],
            reshuffle_excess(summary["trace_cov_high"], self.population),
            summary["effective_measurements"],
        )

    def disagreement(self) -> str:
        """Check the valid sources for coupled examples and against each other (module docstring, rule 5), on
        logging steps (one transfer). Returns what to say, ``""`` when nothing new: a per-example source found
        coupled, or disagreeing with the micro-batch/rank source, is invalidated and named once; two other
        sources that disagree are named once per run and stay weighted by their variances."""
        chosen = self.valid_sources()
        if not chosen or [src.name for src in chosen] == [INDEPENDENT]:  # nothing to check: no transfer
            return ""
        device = chosen[0].ema.count.device
        parts = []
        for src in chosen:
            # Each source on its band window with its sampling error alone: a mean over a stretch of the run, which
            # another source's band window spanning the same steps estimates too, lag or none (rule 5).
            g, t, var_g, var_s, _, n_eff = self._moments(src, device, slow=True)
            z = t_quantile(COUPLING_Z, n_eff - 1)
            age, *drift = src.band_drift().to(device).unbind()
            row = [g, var_g.sqrt(), t, var_s.sqrt(), src.ema.count.to(device).double(), n_eff, z]
            drift = [d * src.unit_scale**2 for d in drift]  # in .grad units, as the means are
            parts.append(torch.stack([*row, coupling_shown(g, var_g, n_eff).double(), age, *drift]))
        rows = torch.stack(parts).cpu().tolist()  # one transfer
        said = []
        for src, (g, g_se, _, _, count, n_eff, z, shown, *_) in zip(chosen, rows):
            if src.name != INDEPENDENT and count >= MIN_MEASUREMENTS and shown:
                src.invalidate(
                    f"its ‖G‖² over its last ≈ {n_eff:.0f} measurements, {g:.3g} ± {g_se:.2g}, is below zero by "
                    f"more than {z:.2g} standard errors, which independent examples cannot give: the examples are "
                    f"coupled, likely by {COUPLING_CAUSES}"
                )
                said.append(f"the noise source {src.name} is dropped from the estimate: {src.invalid}")
        for i in range(len(chosen)):
            for j in range(i + 1, len(chosen)):
                first, second, a, b = chosen[i], chosen[j], rows[i], rows[j]
                if first.invalid or second.invalid:
                    continue
                measurements = torch.tensor(min(a[5], b[5]), dtype=torch.float64)
                z = float(t_quantile(AGREEMENT_Z, measurements - 1))
                for what, k in (("‖G‖²", 0), ("tr(Σ)", 2)):
                    lag = max(a[9 + k // 2], b[9 + k // 2]) * abs(a[8] - b[8])  # the stretches' offset, drifted
                    pair = torch.tensor([a[k], b[k], a[k + 1] ** 2 + b[k + 1] ** 2 + lag**2], dtype=torch.float64)
                    if not bool(sources_apart(*pair.unbind(), measurements)):
                        continue
                    values = f"{a[k]:.4g} ± {a[k + 1]:.2g} vs {b[k]:.4g} ± {b[k + 1]:.2g} on their band windows"
                    if INDEPENDENT in (first.name, second.name) and min(a[4], b[4]) >= MIN_MEASUREMENTS:
                        other = second if first.name == INDEPENDENT else first
                        other.invalidate(
                            f"it disagrees with the micro-batch/rank source on {what} ({first.name} vs "
                            f"{second.name}: {values}, beyond {z:.2g} standard errors); the "
                            f"micro-batches are independent by construction, so the examples are likely "
                            f"coupled by {COUPLING_CAUSES}"
                        )
                        said.append(f"the noise source {other.name} is dropped from the estimate: {other.invalid}")
                        break
                    if not self._said_disagreement and INDEPENDENT not in (first.name, second.name):
                        self._said_disagreement = True
                        said.append(
                            f"the sources {first.name} and {second.name} disagree on {what}: {values} (beyond "
                            f"{z:.2g} standard errors); the combined estimate weights them by their "
                            "variances"
                        )
                        break
        return "; ".join(said)

    def summary_rows(self) -> list[tuple[str, str]]:
        """End-of-run (measure, value) rows of the combined estimate (host floats)."""
        h = self.host_summary()
        rows = [("noise sources", ", ".join(h["sources"]) or "none")]
        if h["count"] == 0:
            return rows + [("estimate", h["why"])]
        batch = h["batch_size"]
        rows += [
            ("effective batch B", f"{batch} examples" if batch else "unknown"),
            (
                "‖G‖² (EMA, `.grad` units)",
                f"{h['grad_sq_norm']:.4g} ± {h['grad_sq_norm_se']:.2g}{_ends(h, 'grad_sq_norm')}",
            ),
            ("tr(Σ) (EMA, `.grad` units)", f"{h['trace_cov']:.4g} ± {h['trace_cov_se']:.2g}{_ends(h, 'trace_cov')}"),
            (
                "B_simple = tr(Σ)/‖G‖²",
                f"{_b_simple_cell(h['b_simple'], h['b_simple_rel_err'])}; {b_simple_interval(h)}",
            ),
            ("effective measurements", f"{h['effective_measurements']:.3g} (of {h['count']:.0f} updates)"),
            (
                "noise level sqrt(tr(Σ)/B): the RMS norm of pure noise, in `.grad` units",
                f"{h['noise_floor']:.4g} ± {h['noise_floor_se']:.2g}",
            ),
            ("expected batch-gradient norm sqrt(‖G‖² + tr(Σ)/B)", f"{h['expected_norm']:.4g}"),
            ("coverage", f"{h['coverage']:.1%} of ‖ḡ‖², {h['param_share']:.1%} of the parameters"),
        ]
        if self.reshuffled and math.isfinite(h["trace_cov_high"]):  # rule 6's δ_R, as noise_intervals allows it
            delta = reshuffle_excess(h["trace_cov_high"], self.population)
            said = (
                f"the ‖G‖² and B_simple intervals allow {delta:.3g} for what a reshuffled epoch can add to the "
                "estimated ‖G‖² (the band is judged without it; RandomSampler(replacement=True) has none)"
            )
            rows.append(("epoch order (reshuffled)", said))
        distinct = [s.distinct_batches for s in self.valid_sources() if s.distinct_batches is not None]
        if distinct:  # rule 9
            left = f"; they allow for the {self.left_out} examples it never draws" if self.left_out else ""
            said = (
                f"the same batches every epoch: the intervals count at most {max(distinct)} effective measurements, "
                f"the distinct batches measured{left} (shuffle=True measures more of them)"
            )
            rows.append(("epoch order (fixed)", said))
        if h["why"]:
            rows.append(("caveat", h["why"]))
        return rows


def b_simple_interval(summary: dict[str, Any]) -> str:
    """B_simple's 90% interval from a :meth:`GradientNoise.host_summary` in words: "B_simple ≥ 180 (90 %)" where
    it has no upper end, "B_simple 120–340 (90 %)" otherwise; "" with no lower bound either."""
    low, high = summary["b_simple_low"], summary["b_simple_high"]
    if not low > 0:
        return "B_simple has no bound yet" if not math.isfinite(high) else f"B_simple ≤ {high:.3g} (90 %)"
    return f"B_simple ≥ {low:.3g} (90 %)" if not math.isfinite(high) else f"B_simple {low:.3g}–{high:.3g} (90 %)"


def _ends(summary: dict[str, Any], name: str) -> str:
    """ ", 90 %: low–high" of ``name``'s interval in a :meth:`GradientNoise.host_summary`; its low end is held at 0
    (the quantity is ≥ 0), so an upper end below it is an estimate below 0 beyond its error, said as such rather
    than as an interval that ends below where it starts ("0–-0.0555")."""
    low, high = summary[f"{name}_low"], summary[f"{name}_high"]
    if not math.isfinite(high):
        return ""
    if high < low:
        return f", 90 %: below 0 beyond its error (upper end {high:.3g})"
    return f", 90 %: {low:.3g}–{high:.3g}"


def _b_simple_cell(b_simple: float, rel_err: float) -> str:
    """B_simple and its relative error in words where either is not a number yet (``inf`` marks that)."""
    if not math.isfinite(b_simple):
        return "none yet: the smoothed ‖G‖² is ≤ 0"
    error = f"relative error {rel_err:.2g}" if math.isfinite(rel_err) else "its error not yet measurable"
    return f"{b_simple:.4g} examples ({error})"


def finite_population(grad_sq_norm: Any, trace_cov: Any, population: int) -> tuple[Any, Any]:
    """Rule 6: (‖G‖², tr Σ) of a batch drawn without replacement from ``population`` = N examples, from the
    estimators' (‖G‖²_est, S_est), made for independent draws: ‖G‖²_est + S_est/N and S_est·(N − 1)/N.
    Tensors of any matching shapes, or floats."""
    return grad_sq_norm + trace_cov / population, trace_cov * (population - 1) / population


def band_ratio(grad_sq_norm: Any, trace_cov: Any, batch_size: int, margin: float) -> Any:
    """‖G‖² over the noise band's edge margin·tr(Σ)/B (≤ 1: inside the band), for floats or tensors alike.

    Raises ``ValueError`` when margin, tr(Σ) or B is not positive (the band has no edge then).
    """
    if not (margin > 0 and batch_size > 0):
        raise ValueError(f"band_ratio needs margin > 0 and batch_size > 0, got {margin!r} and {batch_size!r}")
    return grad_sq_norm * batch_size / (margin * trace_cov)


def coupling_shown(grad_sq_norm: Tensor, var: Tensor, measurements: Tensor) -> Tensor:
    """Where a per-example source's ‖G‖² (a window's EMA mean, any shape) is below zero beyond :data:`COUPLING_Z`
    standard errors, Student-widened at ``measurements`` − 1 degrees of freedom (rule 5): independent examples give
    E[‖G‖²_est] = ‖G‖² ≥ 0 at every step, so a window's mean, lagging or not, has a non-negative expectation too.
    ``var`` is its sampling variance alone (the lag is no error of that claim)."""
    return grad_sq_norm < -t_quantile(COUPLING_Z, measurements - 1) * var.sqrt()


def sources_apart(first: Tensor, second: Tensor, var: Tensor, measurements: Tensor) -> Tensor:
    """Where two sources' band-window means of one quantity (any matching shapes) differ by more than
    :data:`AGREEMENT_Z` standard errors, Student-widened at ``measurements`` − 1 degrees of freedom (rule 5). ``var``
    is the variance of their difference: both windows' sampling variances, plus the square of the drift over the
    offset between the stretches they span (0 for two sources measured at the same steps, whose windows weight the
    same steps alike: a lag is then common to both and cancels)."""
    return (first - second).abs() > t_quantile(AGREEMENT_Z, measurements - 1) * var.sqrt()


def fieller_rel_err(b_simple: Tensor, low: Tensor, high: Tensor, measurements: Tensor) -> Tensor:
    """B_simple's relative error from its own 90% (Fieller) interval ``[low, high]`` (rule 4): the larger distance of
    an end from B_simple, over z·B_simple (z the interval's Student quantile), so that B_simple·(1 ± z·rel_err)
    contains the interval; ``inf`` where the interval has no upper end or B_simple is not positive and finite."""
    z = t_quantile(Z90, measurements - 1)
    point = b_simple.clamp_min(1e-300)
    spread = torch.maximum(high / point - 1.0, 1.0 - low / point) / z.clamp_min(1e-300)
    usable = torch.isfinite(b_simple) & (b_simple > 0) & torch.isfinite(high) & torch.isfinite(z)
    return torch.where(usable, spread, torch.full_like(spread, float("inf")))


def band_window(betas: list[float], steps_per_update: int) -> int:
    """The index, in ``betas`` (longest window first), of the window the band is judged on (rule 7): the longest
    whose memory in optimizer steps, ``steps_per_update``/(1 − β), is at most the slowest decay's at one update a
    step, 1/(1 − β₀); the shortest if none is. A probe every 10 steps then spans the stretch of the run a source
    measured at every step does (its 0.8 rung: 50 steps, as 0.98's at one a step), so a sparser cadence does not
    lengthen the band's memory — per-measurement decay made it 500 steps, and the demo's band was never entered."""
    memory = 1.0 / (1.0 - betas[0])
    fits = [i for i, beta in enumerate(betas) if steps_per_update / (1.0 - beta) <= memory * (1 + 1e-9)]
    return fits[0] if fits else len(betas) - 1


COUNT_TABLE_ROWS = 4096
"""Longest table of :func:`count_terms` a source keeps (:meth:`NoiseSource._count_terms`): decays up to about 0.99."""


def table_rows(beta: float) -> int | None:
    """Rows of a :func:`count_terms` table for a slowest decay ``beta``: the first count t with t·βᵗ below
    2⁻⁵³/10⁴, from which every term equals its limit to float64's resolution; ``None`` beyond
    :data:`COUNT_TABLE_ROWS`."""
    if beta <= 0:
        return 2
    rows = math.ceil((53 * math.log(2) + math.log(1e4)) / -math.log(beta)) + 1
    rows = next(t for t in itertools.count(rows) if t * beta**t < 2**-53 * 1e-4)
    return rows if rows <= COUNT_TABLE_ROWS else None


def count_terms(betas: Tensor, counts: Tensor) -> Tensor:
    """``(T, P)`` float64: per update count in ``counts`` ``(T,)``, what :meth:`NoiseSource.choice` needs of windows
    of decays ``betas`` ``(L,)`` (longest first) that depends on the count alone, packed (:func:`unpack_count_terms`):
    their overlap K ``(L, L)`` (:func:`~trainvitals.noise.estimators.window_overlap`), Bessel factors
    n_eff/(n_eff − 1) ``(L,)``, and per window but the shortest the lag scale A_a/(A_a − A_b) against the next shorter
    window b (mean ages A, :func:`mean_age`) and the spread K_aa + K_bb − 2K_ab of their difference ``(L − 1,)``
    each (rule 7)."""
    t = counts.to(torch.float64)
    b = betas.to(t.device, torch.float64)
    overlap = window_overlap(b, t[:, None, None])
    diag = overlap.diagonal(dim1=1, dim2=2)
    n_eff = 1.0 / diag.clamp_min(1e-300)
    age = mean_age(b, t[:, None])
    step = age[:, :-1] - age[:, 1:]
    scale = torch.where(step > 0, age[:, :-1] / step.clamp_min(1e-300), 0.0)
    spread = (diag[:, :-1] + diag[:, 1:] - 2 * overlap.diagonal(1, dim1=1, dim2=2)).clamp_min(0.0)
    bessel = n_eff / (n_eff - 1).clamp_min(1e-300)
    return torch.cat([overlap.flatten(1), bessel, scale, spread], 1)


def unpack_count_terms(row: Tensor, size: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One row of :func:`count_terms` for ``size`` windows as ``(overlap, bessel, scale, spread)``."""
    overlap, bessel, scale, spread = row.split([size * size, size, size - 1, size - 1])
    return overlap.view(size, size), bessel, scale, spread


def mean_age(betas: Tensor, count: Tensor) -> Tensor:
    """Mean age Σ_k w_k·(t − k) ``(L,)`` float64, in updates, of bias-corrected EMAs of decays ``betas`` after
    ``count`` = t updates: β/(1 − β) − t·βᵗ/(1 − βᵗ) (→ β/(1 − β); 0 after one)."""
    t = count.to(torch.float64)
    b = betas.to(t.device)
    return b / (1 - b) - t * b**t / (1 - b**t).clamp_min(1e-300)


def _pick(values: Tensor, index: Tensor) -> Tensor:
    """``values[index[...], ...]``: per element of ``index`` (the shape of ``values[0]``), the window it names."""
    return values.gather(0, index.unsqueeze(0)).squeeze(0)


INTERVALS = ("grad_sq_norm", "trace_cov", "b_simple", "band_ratio")
"""The quantities :attr:`NoiseEstimate.intervals` holds."""


def _combined_cov(
    s_w: Tensor, g_w: Tensor, cov: Tensor, sd_s: Tensor, sd_g: Tensor, trace_se: Tensor, grad_se: Tensor
) -> Tensor:
    """Cov(tr Σ, ‖G‖²) of the combination: the sources' correlation, weighted as their errors are (rule 3), times
    the combined standard errors; with one source its own covariance."""
    use = (s_w > 0) & (g_w > 0) & torch.isfinite(sd_s * sd_g)
    scale = torch.where(use, s_w * g_w * sd_s * sd_g, 0.0).sum()
    rho = torch.where(use, s_w * g_w * cov, 0.0).sum() / scale.clamp_min(1e-300)
    return torch.where(scale > 0, rho.clamp(-1.0, 1.0) * trace_se * grad_se, torch.zeros_like(scale))


def reshuffle_excess(trace_cov: Any, population: int) -> Any:
    """δ_R, how far above the full-data ‖G‖² the estimate may read on average where each epoch reshuffles
    ``population`` = N examples (module docstring, rule 6): :data:`RESHUFFLE_OVERSHOOT` × SGD's bound 2·tr S/N =
    2·tr Σ/(N − 1) on a quadratic (docs/science.md, "Under random reshuffling"); ``trace_cov`` the tr Σ to read it
    at (the estimate's high end). Floats or tensors."""
    return RESHUFFLE_OVERSHOOT * 2 * trace_cov / (population - 1)


def epoch_order_cause(
    grad_sq_norm: float, grad_se: float, trace_cov: float, trace_high: float, excess: float, measurements: float
) -> str:
    """Why B_simple's interval has no upper end where rule 6's δ_R (``excess``), not ‖G‖²'s error, takes it away:
    ‖G‖² stands clear of zero by its error (t·σ, t Student's at ``measurements``) but not of δ_R, in words with
    what it needs and what would help; ``""`` where that is not the cause. Host floats (a host summary's, or the
    logged tags': the report's). The upper end needs ‖G‖² > δ_R + t·σ, i.e. B_simple < tr Σ/(δ_R + t·σ); δ_R =
    4·tr Σ_high/(N − 1) ≥ 4·tr Σ/N, so ≈ N/4 at best however long the run, and N is read back from δ_R."""
    z = float(t_quantile(Z90, torch.tensor(float(measurements) - 1.0, dtype=torch.float64)))
    if not (
        excess > 0 and math.isfinite(excess) and math.isfinite(z) and z * grad_se < grad_sq_norm <= excess + z * grad_se
    ):
        return ""
    population = RESHUFFLE_OVERSHOOT * 2 * trace_high / excess + 1
    return (
        f"the smoothed ‖G‖², {grad_sq_norm:.3g} ± {grad_se:.2g}, stands clear of zero but not of the {excess:.3g} a "
        f"reshuffled epoch can add to it (δ_R = 4·tr(Σ)/(N − 1) at tr(Σ)'s 90 % high end, N = {population:.0f}), "
        f"so B_simple has no upper bound: on {population:.0f} examples one needs B_simple below "
        f"tr(Σ)/(δ_R + {z:.2g}σ) ≈ {trace_cov / (excess + z * grad_se):.3g} for one (≈ N/4 = {population / 4:.0f} "
        "at best, however long the run); RandomSampler(replacement=True), which has no epoch-order excess, or more "
        "data would give one"
    )


def left_out_variance(grad_sq_norm: Tensor, trace_cov: Tensor, population: int, left_out: int) -> Tensor:
    """What the ``left_out`` = r examples of ``population`` = N that a fixed epoch order never draws add to ‖G‖²'s
    variance against the full data (rule 9): the drawn examples' mean G' = G + r·(G − ḡ_r)/(N − r), with ḡ_r the
    left-out ones' mean as if they were a random r of the N, has Cov(G') = r·Σ/((N − r)(N − 1)), so
    ‖G'‖² − ‖G‖² = 2G·(G' − G) + ‖G' − G‖² has variance 4·GᵀΣG·c ≤ 4·‖G‖²·tr Σ·c (c = r/((N − r)(N − 1))) and mean
    tr Σ·c, here added as a square. Tensors of any matching shapes; a value below 0 counts as 0."""
    share = left_out / ((population - left_out) * (population - 1))
    trace = trace_cov.clamp_min(0.0) * share
    return 4 * grad_sq_norm.clamp_min(0.0) * trace + trace.square()


def noise_intervals(
    grad: Tensor,
    trace: Tensor,
    grad_se: Tensor,
    trace_se: Tensor,
    cov: Tensor,
    measurements: Tensor,
    batch: int | None,
    reshuffled: int | None = None,
) -> dict[str, tuple[Tensor, Tensor]]:
    """The 90% intervals of :attr:`NoiseEstimate.intervals` (module docstring, rule 8) from the EMA means of
    ‖G‖² and tr Σ, their standard errors, covariance and effective number of measurements; elementwise (any
    shape), on the device. z is Student's t quantile at ``measurements − 1`` degrees of freedom. ``reshuffled``:
    N where each epoch reshuffles N examples; the intervals are then the full data's, allowing the epoch order's
    excess δ_R (:func:`reshuffle_excess` at tr Σ's high end): ‖G‖²'s low end less δ_R, B_simple's high end (the band
    ratio's low end) Fieller's at ‖G‖² − δ_R."""
    z = t_quantile(Z90, measurements - 1)
    inf, zero = torch.full_like(grad, float("inf")), torch.zeros_like(grad)
    finite = torch.isfinite(z * grad_se * trace_se)
    grad_iv = (
        torch.where(finite, grad - z * grad_se, zero).clamp_min(0.0),
        torch.where(finite, grad + z * grad_se, inf),
    )
    trace_iv = (
        torch.where(finite, trace - z * trace_se, zero).clamp_min(0.0),
        torch.where(finite, trace + z * trace_se, inf),
    )
    var_s, var_g = torch.where(finite, trace_se.square(), zero), torch.where(finite, grad_se.square(), zero)
    cov, z = torch.where(finite, cov, zero), torch.where(finite, z, zero)
    low, high = fieller_interval(trace, grad, var_s, var_g, cov, z)
    if reshuffled is not None:
        excess = torch.where(finite, reshuffle_excess(trace_iv[1], reshuffled), zero)
        grad_iv = ((grad_iv[0] - excess).clamp_min(0.0), grad_iv[1])
        high = torch.maximum(high, fieller_interval(trace, grad - excess, var_s, var_g, cov, z)[1])
    low, high = torch.where(finite, low, zero), torch.where(finite, high, inf)
    b = float(batch or 1)
    # B/B_simple: 1/inf = 0. Where ‖G‖²'s whole interval is below 0 with tr Σ resolved, Fieller's set for θ ≥ 0 is
    # empty (B_simple: no information), but the ratio's is {0}: ‖G‖² ≤ its upper end < 0 inside the band.
    below = finite & (grad + z * grad_se <= 0) & (trace_iv[0] > 0)
    band = (b / high, torch.where(low > 0, b / low.clamp_min(1e-300), torch.where(below, zero, inf)))
    return {"grad_sq_norm": grad_iv, "trace_cov": trace_iv, "b_simple": (low, high), "band_ratio": band}


def _weights(var: Tensor, seen: Tensor) -> Tensor:
    """Normalised inverse-variance weights over the sources ``seen``; equal weights among them while none
    has a finite variance (a single update each)."""
    inverse = torch.where(seen & torch.isfinite(var), 1.0 / var.clamp_min(1e-300), 0.0)
    fallback = seen.to(var.dtype)
    raw = torch.where(inverse.sum() > 0, inverse, fallback)
    return raw / raw.sum().clamp_min(1e-300)


def _bound(weights: Tensor, sd: Tensor, mask: Tensor | None = None) -> Tensor:
    """Σ_k w_k σ_k over the sources with weight (an upper bound on the standard error for any correlation)."""
    use = weights > 0 if mask is None else mask
    return torch.where(use, weights * sd, 0.0).sum()


def reshuffles(loader: Any) -> bool:
    """Whether ``loader`` draws a new permutation of its examples each epoch (``RandomSampler`` without replacement,
    a ``DistributedSampler`` with ``shuffle``): where rule 6's epoch-order excess arises."""
    from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

    if not isinstance(loader, DataLoader):
        return False
    sampler = loader.sampler
    if isinstance(sampler, RandomSampler):
        return not sampler.replacement and sampler._num_samples is None
    return isinstance(sampler, DistributedSampler) and bool(sampler.shuffle)


def population_of(loader: Any) -> int | None:
    """N, the dataset's length, when ``loader`` draws every example once per epoch (sequential, shuffled
    without replacement, a DistributedSampler): what :attr:`GradientNoise.population` corrects for; ``None``
    for sampling with replacement, another sampler, or a dataset without a length."""
    from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, SequentialSampler

    if not isinstance(loader, DataLoader):
        return None
    sampler = loader.sampler
    if isinstance(sampler, RandomSampler) and (sampler.replacement or sampler._num_samples is not None):
        return None
    if not isinstance(sampler, (RandomSampler, SequentialSampler, DistributedSampler)):
        return None
    try:
        n = len(loader.dataset)  # type: ignore[arg-type]
    except TypeError:
        return None
    return n if n >= 2 else None
