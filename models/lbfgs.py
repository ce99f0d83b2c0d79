"""L-BFGS with a strong Wolfe line search on a flat float64 vector: torch.optim.LBFGS's algorithm
(torch 2.14, `line_search_fn="strong_wolfe"`), step for step, for the post-hoc calibrators
(models/posthoc.py) and their cross-validation.

Why not torch.optim.LBFGS itself: the calibrators' objectives have a few dozen to a few hundred
parameters, so each step is hundreds of tiny tensor operations (the two-loop recursion over a
history of 20, autograd's forward and backward, the optimizer's flatten/unflatten copies) whose
per-call overhead is the whole cost; and the first LBFGS built in a process imports
torch._dynamo (seconds). Here the objective hands back its own gradient (closed form, numpy),
and the history's product with the gradient is the two-loop recursion's compact matrix form.

The iterates are torch's: the same initial step min(1, 1/Σ|g|), the same history update
(skipped when yᵀs ≤ 1e-10), the same cubic interpolation, bracketing and zoom, the same stopping
rules (max |g| ≤ tolerance_grad, iterations, evaluations = 5/4 of the iterations by default,
gᵀd > −tolerance_change, max |t·d| or |Δf| below tolerance_change; the line search's own
tolerance_change is torch's default 1e-9, which torch's step does not pass on). Only rounding
differs (the objective's, the products' order), so a fit that converges agrees with torch's to
far below the 1e-4 the calibrators are held to, and on Rosenbrock's valley both take the same
number of evaluations (tests/test_posthoc.py). A fit stopped by the cap before converging
stops where rounding led it, in torch's code as here: there only the objective agrees.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

Objective = Callable[[np.ndarray], tuple[float, np.ndarray]]  # theta -> (f, df/dtheta)


def _cubic_interpolate(x1, f1, g1, x2, f2, g2, bounds=None) -> float:
    """The minimiser of the cubic through (x1, f1, g1) and (x2, f2, g2), clamped to `bounds`
    (default: between the two points); their midpoint when the cubic has no real minimiser."""
    xmin_bound, xmax_bound = bounds if bounds is not None else (min(x1, x2), max(x1, x2))
    d1 = g1 + g2 - 3 * (f1 - f2) / (x1 - x2)
    d2_square = d1**2 - g1 * g2
    if d2_square < 0:
        return (xmin_bound + xmax_bound) / 2.0
    d2 = math.sqrt(d2_square)
    if x1 <= x2:
        min_pos = x2 - (x2 - x1) * ((g2 + d2 - d1) / (g2 - g1 + 2 * d2))
    else:
        min_pos = x1 - (x1 - x2) * ((g1 + d2 - d1) / (g1 - g2 + 2 * d2))
    return min(max(min_pos, xmin_bound), xmax_bound)


def _strong_wolfe(
    fun: Objective,
    x: np.ndarray,
    t: float,
    d: np.ndarray,
    f: float,
    g: np.ndarray,
    gtd: float,
    max_ls: int,
    c1: float = 1e-4,
    c2: float = 0.9,
    tolerance_change: float = 1e-9,
) -> tuple[float, np.ndarray, float, int]:
    """(f, g, t, evaluations) at a step t along d satisfying the strong Wolfe conditions:
    1. bracket an interval holding such a step, 2. zoom into it by cubic interpolation."""
    d_norm = float(np.abs(d).max())
    f_new, g_new = fun(x + t * d)
    evals = 1
    gtd_new = float(g_new @ d)
    # 1. Bracketing.
    t_prev, f_prev, g_prev, gtd_prev = 0.0, f, g, gtd
    done = False
    ls_iter = 0
    while ls_iter < max_ls:
        if f_new > (f + c1 * t * gtd) or (ls_iter > 1 and f_new >= f_prev):
            bracket, bracket_f = [t_prev, t], [f_prev, f_new]
            bracket_g, bracket_gtd = [g_prev, g_new], [gtd_prev, gtd_new]
            break
        if abs(gtd_new) <= -c2 * gtd:
            bracket, bracket_f, bracket_g = [t], [f_new], [g_new]
            done = True
            break
        if gtd_new >= 0:
            bracket, bracket_f = [t_prev, t], [f_prev, f_new]
            bracket_g, bracket_gtd = [g_prev, g_new], [gtd_prev, gtd_new]
            break
        bounds = (t + 0.01 * (t - t_prev), t * 10)  # extrapolate: at least 1 % further
        t_next = _cubic_interpolate(t_prev, f_prev, gtd_prev, t, f_new, gtd_new, bounds=bounds)
        t_prev, t = t, t_next
        f_prev, g_prev, gtd_prev = f_new, g_new, gtd_new
        f_new, g_new = fun(x + t * d)
        evals += 1
        gtd_new = float(g_new @ d)
        ls_iter += 1
    if ls_iter == max_ls:
        bracket, bracket_f, bracket_g = [0.0, t], [f, f_new], [g, g_new]
    # 2. Zoom: shrink the bracket until a point satisfies the conditions.
    insuf_progress = False
    low_pos, high_pos = (0, 1) if bracket_f[0] <= bracket_f[-1] else (1, 0)
    while not done and ls_iter < max_ls:
        if abs(bracket[1] - bracket[0]) * d_norm < tolerance_change:
            break
        t = _cubic_interpolate(
            bracket[0], bracket_f[0], bracket_gtd[0], bracket[1], bracket_f[1], bracket_gtd[1]
        )
        # a trial too close to an end of the bracket twice (or outside it) moves 0.1 of the
        # bracket's length inside
        hi, lo = max(bracket), min(bracket)
        eps = 0.1 * (hi - lo)
        if min(hi - t, t - lo) < eps:
            if insuf_progress or t >= hi or t <= lo:
                t = hi - eps if abs(t - hi) < abs(t - lo) else lo + eps
                insuf_progress = False
            else:
                insuf_progress = True
        else:
            insuf_progress = False
        f_new, g_new = fun(x + t * d)
        evals += 1
        gtd_new = float(g_new @ d)
        ls_iter += 1
        if f_new > (f + c1 * t * gtd) or f_new >= bracket_f[low_pos]:
            bracket[high_pos], bracket_f[high_pos] = t, f_new
            bracket_g[high_pos], bracket_gtd[high_pos] = g_new, gtd_new
            low_pos, high_pos = (0, 1) if bracket_f[0] <= bracket_f[1] else (1, 0)
        else:
            if abs(gtd_new) <= -c2 * gtd:
                done = True
            elif gtd_new * (bracket[high_pos] - bracket[low_pos]) >= 0:
                bracket[high_pos], bracket_f[high_pos] = bracket[low_pos], bracket_f[low_pos]
                bracket_g[high_pos] = bracket_g[low_pos]
                bracket_gtd[high_pos] = bracket_gtd[low_pos]
            bracket[low_pos], bracket_f[low_pos] = t, f_new
            bracket_g[low_pos], bracket_gtd[low_pos] = g_new, gtd_new
    return bracket_f[low_pos], bracket_g[low_pos], bracket[low_pos], evals


def _inverse_hessian_times(s: np.ndarray, y: np.ndarray, gamma: float, q: np.ndarray) -> np.ndarray:
    """H q for the L-BFGS inverse Hessian H of the history s_i = Δx, y_i = Δg (rows, oldest
    first) on γ·I: the two-loop recursion's product in its compact form (Byrd, Nocedal &
    Schnabel 1994; Nocedal & Wright eq. 7.24), a dozen matrix operations instead of 4m vector
    ones, equal to it up to rounding:

        H q = γ q + Sᵀ R⁻ᵀ((D + γ Y Yᵀ) u − γ Y q) − γ Yᵀ u,   u = R⁻¹ S q,

    with R the upper triangle of S Yᵀ (R_ij = s_iᵀ y_j, i ≤ j) and D its diagonal."""
    sy = s @ y.T
    r = np.triu(sy)
    u = np.linalg.solve(r, s @ q)
    inner = (np.diag(sy) * u + gamma * (y @ (y.T @ u))) - gamma * (y @ q)
    return gamma * q + s.T @ np.linalg.solve(r.T, inner) - gamma * (y.T @ u)


def minimise(
    fun: Objective,
    x0: np.ndarray,
    max_iter: int = 300,
    max_eval: int | None = None,
    tolerance_grad: float = 1e-7,
    tolerance_change: float = 1e-12,
    history_size: int = 20,
) -> np.ndarray:
    """argmin of fun from x0 by L-BFGS (lr 1, strong Wolfe): torch.optim.LBFGS(...).step(closure)
    with these arguments, one call. max_eval defaults to torch's max_iter * 5 // 4."""
    max_eval = max_iter * 5 // 4 if max_eval is None else max_eval
    x = np.array(x0, dtype=np.float64)
    loss, g = fun(x)
    evals = 1
    if np.abs(g).max() <= tolerance_grad:
        return x
    old_dirs: list[np.ndarray] = []  # y = Δg
    old_stps: list[np.ndarray] = []  # s = Δx
    ro: list[float] = []  # 1 / yᵀs
    h_diag = 1.0
    d, t, prev_g = -g, 1.0, g
    for n_iter in range(1, max_iter + 1):
        # 1. The direction: -g first, then the L-BFGS inverse Hessian of the history times -g.
        if n_iter == 1:
            d = -g
        else:
            y, s = g - prev_g, d * t
            ys = float(y @ s)
            if ys > 1e-10:
                if len(old_dirs) == history_size:
                    old_dirs.pop(0), old_stps.pop(0), ro.pop(0)
                old_dirs.append(y), old_stps.append(s), ro.append(1.0 / ys)
                h_diag = ys / float(y @ y)
            d = _inverse_hessian_times(np.array(old_stps), np.array(old_dirs), h_diag, -g)
        prev_g, prev_loss = g, loss
        # 2. The step along d.
        t = min(1.0, 1.0 / float(np.abs(g).sum())) if n_iter == 1 else 1.0
        gtd = float(g @ d)
        if gtd > -tolerance_change:
            break
        loss, g, t, ls_evals = _strong_wolfe(fun, x, t, d, loss, g, gtd, max_eval - evals)
        x = x + t * d
        evals += ls_evals
        # 3. Stop: converged, out of budget, or no progress.
        if n_iter == max_iter or evals >= max_eval or np.abs(g).max() <= tolerance_grad:
            break
        if np.abs(d * t).max() <= tolerance_change or abs(loss - prev_loss) < tolerance_change:
            break
    return x
