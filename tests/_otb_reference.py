"""The optimal token baseline written out per group and slot, in float64, with error bounds.

:func:`otb_reference` follows the definition of
:func:`dapo_ops.optimal_token_baseline_advantages` (verl's ``optimal_token_baseline`` and
``tir_optimal_token_baseline``) with plain Python loops over groups, rows and slots, and
bounds how far an evaluation of it in ``dtype`` arithmetic (any order of the sums, as in
tests/_bounds.py) may lie from this float64 evaluation. The derivation, with ``u`` and
``f`` the unit roundoff and the elementary-function error of ``dtype`` plus float64's (the
reference's own), ``S`` the row width and ``N`` the group size:

- ``w = (1 - 2 e^l + s) rho^2``: one ``exp`` and at most 5 roundings, of terms at most
  ``M = (1 + 2 e^l + |s|) rho^2``, so ``|dw| <= (f + gamma(5)) M``;
- ``W_t``, a running sum of at most ``S`` of them: ``(f + gamma(S + 5)) sum_{t' <= t} M``;
- ``G_t``, a reverse running sum of at most ``S`` rewards: ``gamma(S) sum_{t' >= t} |r|``;
- ``P = G W``: ``|G| eW + |W| eG + eG eW + u |P|``;
- ``num = sum_i P_i`` over ``N`` rows: ``sum eP + gamma(N) sum |P|``; ``den = sum_i W_i +
  eps``: ``sum eW + gamma(N + 1) (sum |W| + eps)``;
- ``b = num / den``: ``(e_num + |b| e_den) / (|den| - e_den) + u |b|`` (unbounded when
  ``e_den >= |den|``);
- ``A = G - b``: ``eG + e_b + u (|G| + |b|)``.

Magnitudes are those of the float64 values (a second-order difference from the exact ones).
The zero-tail rule and the group sizes are integer decisions, the same on both sides.
"""

from __future__ import annotations

import torch
from _bounds import F64, func_rel, gamma_ref, unit_roundoff


def otb_reference(
    rewards: torch.Tensor,
    old_logp: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    mask: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    is_weights: torch.Tensor | None = None,
    align: str = "position",
    zero_tail: bool = True,
    eps: float = 1e-8,
    dtype: torch.dtype = F64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(advantages, returns, advantage bound, returns bound)`` in float64."""
    m = mask.bool()
    r = torch.where(m, rewards.double(), 0.0)
    old, s2 = old_logp.double(), sum_pi_squared.double()
    rho2 = torch.ones_like(r) if is_weights is None else is_weights.double() ** 2
    batch, seq = r.shape
    u = unit_roundoff(dtype) + unit_roundoff(F64)
    f = func_rel(dtype) + func_rel(F64)

    returns = r.flip(-1).cumsum(-1).flip(-1)
    e_g = gamma_ref(seq, dtype) * r.abs().flip(-1).cumsum(-1).flip(-1)
    w = torch.where(m, (1 - 2 * old.exp() + s2) * rho2, 0.0)
    big_m = torch.where(m, (1 + 2 * old.exp() + s2.abs()) * rho2, 0.0)
    big_w = w.cumsum(-1)
    e_w = (f + gamma_ref(seq + 5, dtype)) * big_m.cumsum(-1)

    lengths = [int(x) for x in m.sum(-1)]
    # slot k of row i -> its position; "position": every valid t is slot t
    slots = [
        {t: t for t in range(seq) if m[i, t]}
        if align == "position"
        else dict(enumerate(t for t in range(seq) if m[i, t]))
        for i in range(batch)
    ]
    groups: dict[int, list[int]] = {}
    for i in range(batch):
        if align == "response_token" and lengths[i] == 0:
            continue
        groups.setdefault(int(group_ids[i]), []).append(i)

    adv = torch.zeros_like(r)
    bound = torch.zeros_like(r)
    for rows in groups.values():
        n = len(rows)
        tail_row, tail_from = -1, seq + 1
        ls = sorted(lengths[j] for j in rows)
        if zero_tail and n >= 2 and ls[-1] > ls[-2]:
            tail_row = next(j for j in rows if lengths[j] == ls[-1])
            tail_from = ls[-2]
        for i in rows:
            for k, t in slots[i].items():
                g, eg = float(returns[i, t]), float(e_g[i, t])
                b = eb = 0.0
                if n >= 2 and not (i == tail_row and k >= tail_from):
                    num = e_num = abs_p = 0.0
                    den = e_den = abs_w = 0.0
                    for j in rows:
                        if k not in slots[j]:
                            continue
                        tj = slots[j][k]
                        gj, wj = float(returns[j, tj]), float(big_w[j, tj])
                        egj, ewj = float(e_g[j, tj]), float(e_w[j, tj])
                        num += gj * wj
                        abs_p += abs(gj * wj)
                        e_num += abs(gj) * ewj + abs(wj) * egj + egj * ewj + u * abs(gj * wj)
                        den += wj
                        abs_w += abs(wj)
                        e_den += ewj
                    den += eps
                    e_num += gamma_ref(n, dtype) * abs_p
                    e_den += gamma_ref(n + 1, dtype) * (abs_w + eps)
                    b = num / den
                    if abs(den) > e_den:
                        eb = (e_num + abs(b) * e_den) / (abs(den) - e_den) + u * abs(b)
                    else:
                        eb = float("inf")
                adv[i, t] = g - b
                bound[i, t] = eg + eb + u * (abs(g) + abs(b))
    return adv, returns, bound, e_g
