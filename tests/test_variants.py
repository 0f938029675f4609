"""GSPO, CISPO, KL estimators, truncated IS, presets and peer-exact options."""

from __future__ import annotations

import math

import pytest
import torch
from _bounds import (
    F64,
    advantage_bound,
    assert_within,
    func_rel,
    gamma,
    gamma_ref,
    loss_reference,
    scale_of,
    unit_roundoff,
)
from _strategies import MODES, PolicyBatch, make_batch, policy_batches
from hypothesis import given
from hypothesis import strategies as st

import dapo_ops as d

# --- GSPO -------------------------------------------------------------------------


@given(st.integers(1, 6), st.integers(1, 12), st.integers(0, 2**31 - 1), st.floats(-0.5, 0.5))
def test_gspo_equals_token_ppo_when_token_ratios_are_equal(
    batch: int, seq: int, seed: int, shift: float
) -> None:
    b = make_batch(batch, seq, seed)
    g = torch.Generator().manual_seed(seed)
    # Dyadic values (multiples of 2^-10, |x| < 16): logp - old_logp is then exactly the
    # per-sequence log-ratio in float32, so every token's ratio is exp of the same number.
    old = torch.round(b.old_logp * 1024) / 1024 - 4  # logp = old + per_seq stays < 0
    per_seq = torch.round(torch.randn(batch, 1, generator=g) * shift * 1024) / 1024
    logp = (old + per_seq).requires_grad_(True)
    assert torch.equal(
        torch.where(b.mask, logp.detach() - old, 0.0), torch.where(b.mask, per_seq, 0.0)
    )
    logp2 = logp.detach().clone().requires_grad_(True)
    eps = {"eps_low": 0.2, "eps_high": 0.28}
    gspo = d.gspo_surrogate(logp, old, b.advantages, b.mask, **eps)
    ppo = d.clip_higher_surrogate(logp2, old, b.advantages, b.mask, **eps)
    gspo.sum().backward()
    ppo.sum().backward()
    assert logp.grad is not None and logp2.grad is not None
    # The exact value of both, in float64: every token of row i has the ratio r = e^x,
    # x = per_seq[i] (exact), so the loss is -min(r A, clip(r) A) and its gradient -A r
    # where the clip is not active, 0 where it is.
    x = per_seq.double().expand(batch, seq)
    r, a = x.exp(), b.advantages.double()[:, None].expand(batch, seq)
    lo, hi = 1 - eps["eps_low"], 1 + eps["eps_high"]
    want = -torch.minimum(r * a, r.clamp(lo, hi) * a)
    active = ((a > 0) & (r > hi)) | ((a < 0) & (r < lo))
    want_grad = torch.where(active, 0.0, -a * r)
    # Each float32 path: GSPO's mean of the equal log-ratios may round (a sum times 1 / n:
    # 2 u |x|), exp adds f, the clip bounds, the rescaling by the length and the products
    # with A and the upstream gradient round at most 6 times: r within f + 2u|x| + 6u, the
    # results within that of |A| max(r, 1 + eps_high) (float64's own terms added). Within
    # that bound of a clip bound the clip decision may go either way: there the gradient's
    # bound is the whole |A r|.
    rel = sum(func_rel(dt) + unit_roundoff(dt) * (2 * x.abs() + 6) for dt in (torch.float32, F64))
    mag = a.abs() * torch.maximum(r, torch.tensor(hi, dtype=F64))
    near = ((r - lo).abs() <= 2 * rel * r) | ((r - hi).abs() <= 2 * rel * r)
    bound = torch.where(b.mask, rel * mag, 0.0)
    grad_bound = torch.where(b.mask, rel * mag + torch.where(near, (a * r).abs(), 0.0), 0.0)
    for loss, grad, what in ((gspo, logp.grad, "GSPO"), (ppo, logp2.grad, "token PPO")):
        assert_within(loss, torch.where(b.mask, want, 0.0), bound, f"{what} loss")
        assert_within(grad, torch.where(b.mask, want_grad, 0.0), grad_bound, f"{what} gradient")


@given(policy_batches())
def test_gspo_ratio_is_the_geometric_mean(b: PolicyBatch) -> None:
    s = d.gspo_sequence_ratio(b.logp, b.old_logp, b.mask)
    # exact: exp of the mean of the (+-20 clamped) token log-ratios, clamped to +-10; the
    # float32 value is off by f + u (|d|max + 1) + gamma(n + 1) mean|d| relative (the log
    # differences round by u|d|, their mean by gamma(n + 1), exp adds f), float64's too
    for i in range(b.logp.shape[0]):
        dd = (b.logp[i].double() - b.old_logp[i].double())[b.mask[i]].clamp(-20, 20)
        if not len(dd):
            assert s[i].item() == 1.0
            continue
        want = torch.exp(dd.mean().clamp(-10, 10))
        n = len(dd)
        rel = sum(
            func_rel(dt) + unit_roundoff(dt) * (float(dd.abs().max()) + 1)
            + gamma(n + 1, dt) * float(dd.abs().mean())
            for dt in (torch.float32, F64)
        )  # fmt: skip
        assert_within(s[i], want, rel * float(want), f"row {i}")


@given(policy_batches(max_batch=4, max_seq=10))
def test_gspo_gradient_is_the_papers(b: PolicyBatch) -> None:
    # J = (1/G) sum_i min(s_i A_i, clip(s_i) A_i); grad wrt logp_{i,t} = s_i A_i / |y_i| / G
    # when unclipped, 0 when clipped
    logp = b.logp.clone().requires_grad_(True)
    eps_low, eps_high = 0.1, 0.1
    loss = d.token_level_aggregate(
        d.gspo_surrogate(
            logp, b.old_logp, b.advantages, b.mask, eps_low=eps_low, eps_high=eps_high
        ),
        b.mask,
        mode="seq_mean_token_mean",
    )
    loss.backward()
    s = d.gspo_sequence_ratio(b.logp, b.old_logp, b.mask)
    n = b.mask.sum(-1)
    groups = int((n > 0).sum())
    for i in range(b.logp.shape[0]):
        if n[i] == 0:
            continue
        a = float(b.advantages[i])
        si = float(s[i])
        if any(
            abs(si - e) <= unit_roundoff(torch.float32) * e for e in (1 - eps_low, 1 + eps_high)
        ):
            continue  # on a clip bound rounded to float32: the decision is the rounding's
        clipped = (a > 0 and si > 1 + eps_high) or (a < 0 and si < 1 - eps_low)
        want = 0.0 if clipped else -si * a / int(n[i]) / groups
        assert logp.grad is not None
        # the same float32 s_i, times A, over n_i and |S|: four roundings (float64's too)
        bound = 4 * (unit_roundoff(torch.float32) + unit_roundoff(F64)) * abs(want)
        got = logp.grad[i][b.mask[i]]
        assert_within(got, torch.full(got.shape, want, dtype=F64), bound, f"row {i}")


# --- CISPO ------------------------------------------------------------------------


@given(policy_batches(), st.floats(1.0, 4.0), st.floats(0.0, 1.0))
def test_cispo_gradient_is_the_clipped_weight_and_bounded_by_cap(
    b: PolicyBatch, cap: float, floor: float
) -> None:
    logp = b.logp.clone().requires_grad_(True)
    d.cispo_surrogate(logp, b.old_logp, b.advantages, b.mask, cap=cap, floor=floor).sum().backward()
    assert logp.grad is not None
    a = b.advantages[:, None].expand_as(b.logp).double()
    dd = b.logp.double() - b.old_logp.double()
    w = dd.exp().clamp(floor, cap)
    # float32: d rounds by u|d|, exp adds f, the clamp is exact, * -A rounds once (the
    # float64 reference's own terms added)
    rel = sum(func_rel(dt) + unit_roundoff(dt) * (dd.abs() + 2) for dt in (torch.float32, F64))
    want = torch.where(b.mask, -w * a, 0.0)
    assert_within(logp.grad, want, torch.where(b.mask, rel * (w * a).abs(), 0.0), "gradient")
    # |grad| <= cap |A|, up to the product's rounding
    assert bool((logp.grad.double().abs() <= cap * a.abs() * (1 + rel)).all())


# --- KL ---------------------------------------------------------------------------


@given(policy_batches(), st.sampled_from(["k1", "k2", "k3"]))
def test_kl_estimators(b: PolicyBatch, estimator: str) -> None:
    kl = d.kl_penalty(b.logp, b.old_logp, b.mask, estimator=estimator)  # type: ignore[arg-type]
    delta = b.logp.double() - b.old_logp.double()
    want = {"k1": delta, "k2": delta**2 / 2, "k3": torch.exp(-delta) + delta - 1}[estimator]
    # float32: delta rounds by u|delta| (k2 squares it: 3 roundings), exp adds f; k3's
    # three terms (magnitudes e^-delta, |delta|, 1): 3 roundings. The float64 reference's
    # delta is exact (a difference of float32 values), the rest rounds as float32 does,
    # with float64's u and f: gamma_ref(k) plus both f.
    f, u = func_rel(torch.float32) + func_rel(F64), unit_roundoff(torch.float32)
    mag = {"k1": delta.abs(), "k2": delta**2, "k3": torch.exp(-delta) + delta.abs() + 1}
    k = {"k1": 1, "k2": 3, "k3": 3}[estimator]
    rel = gamma_ref(k, torch.float32) + (f if estimator == "k3" else 0.0)
    err = rel * mag[estimator] + ((-delta).exp() * u * delta.abs() if estimator == "k3" else 0)
    assert_within(kl, torch.where(b.mask, want, 0.0), torch.where(b.mask, err, 0.0), estimator)
    if estimator != "k1":
        assert bool((kl >= 0).all())
    same = d.kl_penalty(b.logp, b.logp, b.mask, estimator=estimator)  # type: ignore[arg-type]
    assert bool((same == 0).all())


def test_kl_zero_exactly_where_equal_only() -> None:
    logp = torch.tensor([[-1.0, -2.0, -3.0]])
    ref = torch.tensor([[-1.0, -2.5, -3.0]])
    for est in ("k1", "k2", "k3"):
        kl = d.kl_penalty(logp, ref, estimator=est)  # type: ignore[arg-type]
        assert kl[0, 0] == 0 and kl[0, 2] == 0 and kl[0, 1] != 0


# --- truncated IS -----------------------------------------------------------------


@given(policy_batches(), st.floats(1.0, 5.0))
def test_truncated_is_weights(b: PolicyBatch, cap: float) -> None:
    tok = d.truncated_is_weights(b.old_logp, b.logp, b.mask, cap=cap)
    # exact in float64 on the same inputs; float32: u |d| + f relative, the cap exact
    # (rounded to float32: u); float64's own terms added
    dd = b.old_logp.double() - b.logp.double()
    want = dd.exp().clamp(max=cap)
    rel = sum(func_rel(dt) + unit_roundoff(dt) * (dd.abs() + 2) for dt in (torch.float32, F64))
    assert_within(tok, torch.where(b.mask, want, 0.0), torch.where(b.mask, rel * want, 0.0))
    seq = d.truncated_is_weights(b.old_logp, b.logp, b.mask, cap=cap, level="sequence")
    for i in range(b.logp.shape[0]):
        row = dd[i][b.mask[i]]
        vals = seq[i][b.mask[i]]
        if vals.numel():
            # the sequence's log-weight sums n rounded differences: gamma(n) sum|d| absolute
            # (the float64 reference's sum: gamma_ref), then exp adds f (float64's too) and
            # the cap rounds to float32 (u)
            log_w = row.sum().clamp(-20, 20)
            w = math.exp(min(float(log_w), math.log(cap)))
            err = gamma_ref(len(row) + 1, torch.float32) * float(row.abs().sum())
            rel_w = func_rel(torch.float32) + func_rel(F64) + err + unit_roundoff(torch.float32)
            assert_within(vals, torch.full_like(vals, w, dtype=F64), rel_w * w, f"row {i}")
    assert not tok.requires_grad and bool((seq[~b.mask] == 0).all())


def test_loss_with_is_weights_and_kl_is_the_composition() -> None:
    b = make_batch(4, 6, 7)
    ref = b.old_logp - 0.1
    w = d.truncated_is_weights(b.old_logp, b.old_logp + 0.05, b.mask)
    got = d.token_level_loss(
        b.logp, b.old_logp, b.advantages, b.mask, is_weights=w, ref_logp=ref, kl_beta=0.04
    )
    per_token = d.clip_higher_surrogate(b.logp, b.old_logp, b.advantages, b.mask) * w
    per_token = per_token + 0.04 * d.kl_penalty(b.logp, ref, b.mask)
    composed = d.token_level_aggregate(per_token, b.mask)
    # both within the bound of the same composition in float64: per token at most 30
    # operations and elementary functions on magnitudes |A| r w + beta (e^x + |x| + 1),
    # then a mean over n tokens
    x64 = ref.double() - b.logp.double()
    r64 = (b.logp.double() - b.old_logp.double()).exp()
    mag = b.advantages.double().abs()[:, None] * r64 * w.double() + 0.04 * (
        x64.exp() + x64.abs() + 1
    )
    n = int(b.mask.sum())
    c = sum(30 * func_rel(dt) + gamma(30 + n + 2, dt) for dt in (torch.float32, F64))
    bound = c * float(torch.where(b.mask, mag, 0.0).sum()) / n
    lp64 = b.logp.double()
    want = d.token_level_loss(
        lp64, b.old_logp.double(), b.advantages.double(), b.mask, is_weights=w.double(),
        ref_logp=ref.double(), kl_beta=0.04,
    )  # fmt: skip
    assert_within(got, want, bound, "token_level_loss")
    assert_within(composed, want, bound, "composition")
    with pytest.raises(ValueError, match="ref_logp"):
        d.token_level_loss(b.logp, b.old_logp, b.advantages, b.mask, kl_beta=0.1)


# --- presets ----------------------------------------------------------------------


def paper_loss(
    preset: d.ObjectivePreset, b: PolicyBatch, ref: torch.Tensor, max_len: int
) -> torch.Tensor:
    """Each objective as its paper writes it, in float64 with Python loops over sequences."""
    total, count = torch.tensor(0.0, dtype=torch.float64), 0
    tokens = int(b.mask.sum())
    for i in range(b.logp.shape[0]):
        m = b.mask[i]
        if not bool(m.any()):
            continue
        count += 1
        lp, old, rf = b.logp[i][m].double(), b.old_logp[i][m].double(), ref[i][m].double()
        a = float(b.advantages[i])
        obj = preset.objective
        assert isinstance(obj, (d.GSPO, d.CISPO, d.ClipHigher))
        if isinstance(obj, d.GSPO):
            s = torch.exp((lp - old).mean())
            terms = -torch.min(s * a, s.clamp(1 - obj.eps_low, 1 + obj.eps_high) * a).expand_as(lp)
        elif isinstance(obj, d.CISPO):
            w = torch.exp(lp - old).clamp(max(0.0, 1 - obj.eps_low), 1 + obj.eps_high)
            terms = -w * a * lp
        else:
            r = torch.exp(lp - old)
            terms = -torch.min(r * a, r.clamp(1 - obj.eps_low, 1 + obj.eps_high) * a)
        if preset.kl is not None:
            terms = terms + preset.kl.beta * (torch.exp(rf - lp) - (rf - lp) - 1)
        if preset.mode == "token_mean":
            total = total + terms.sum() / tokens
        elif preset.mode == "seq_mean_token_mean":
            total = total + terms.mean()
        elif preset.mode == "seq_mean_token_sum_norm":
            total = total + terms.sum() / max_len
        else:
            total = total + terms.sum()
    return total if preset.mode == "token_mean" else total / max(count, 1)


@pytest.mark.parametrize("name", list(d.presets.PRESETS))
@given(b=policy_batches())
def test_presets_reproduce_their_papers(name: str, b: PolicyBatch) -> None:
    preset = d.presets.PRESETS[name]
    ref = b.old_logp - 0.1
    got = preset.loss(
        b.logp,
        b.old_logp,
        b.advantages,
        b.mask,
        ref_logp=ref if preset.kl is not None else None,
        max_len=32,
    )
    # Bound: per token at most K = 30 + seq operations and elementary functions (the
    # sequence ratio sums a row) on magnitudes |A| (r + s + 2)(1 + |logp|) (ratio, sequence
    # ratio, clip bounds; CISPO multiplies by log p) + beta (e^x + |x| + 1) (k3), combined by
    # the preset's aggregation: c = K f + gamma(K + n) of the aggregated magnitudes.
    lp, old = b.logp.double(), b.old_logp.double()
    dd = lp - old
    n_tok = b.mask.sum(-1, keepdim=True).clamp(min=1)
    s_seq = (torch.where(b.mask, dd, 0.0).sum(-1, keepdim=True) / n_tok).clamp(-10, 10).exp()
    mag = b.advantages.double().abs()[:, None] * (dd.exp() + s_seq + 2) * (1 + lp.abs())
    if preset.kl is not None:
        x = ref.double() - lp
        mag = mag + preset.kl.beta * (x.exp() + x.abs() + 1)
    agg = d.token_level_aggregate(mag, b.mask, mode=preset.mode, max_len=32)
    k = 30 + b.logp.shape[1]
    c = sum(k * func_rel(dt) + gamma(k + b.logp.numel(), dt) for dt in (torch.float32, F64))
    assert_within(got, paper_loss(preset, b, ref, 32), c * float(agg), name)


def test_preset_advantages_and_replace() -> None:
    dapo = d.presets.DAPO
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    assert torch.equal(dapo.advantages(r), d.group_advantages(r))  # the same function
    assert torch.equal(d.presets.DR_GRPO.advantages(r), r - 0.5)  # mean 0.5: exact
    c = dapo.replace(objective=d.ClipHigher(dual_clip=3.0))
    assert c.objective == d.ClipHigher(eps_low=0.2, eps_high=0.28, dual_clip=3.0)
    assert dapo.objective == d.ClipHigher(eps_low=0.2, eps_high=0.28) and c.name == "dapo"
    assert dapo.kl is None and dapo.dynamic_sampling and dapo.overlong_penalty
    assert dapo.verl["clip_ratio_high"] == 0.28 and dapo.trl["loss_type"] == "dapo"


def test_presets_are_validated_and_own_read_only_peer_mappings() -> None:
    dapo = d.presets.DAPO
    # InputError, or the runtime annotation checker's error (a ValueError too) in this suite
    with pytest.raises(ValueError, match="objective"):
        dapo.replace(objective="ppo")
    with pytest.raises(ValueError, match="mode"):
        dapo.replace(mode="token-mean")
    with pytest.raises(d.InputError, match="beta"):
        d.presets.GRPO.replace(kl=d.KLPenalty(beta=-1.0))
    with pytest.raises(TypeError, match="dual_clip"):  # GSPO has no dual clip: no such field
        d.presets.GSPO.replace(objective=d.GSPO(dual_clip=3.0))  # type: ignore[call-arg]
    derived = dapo.replace(name="mine")
    with pytest.raises(TypeError):
        derived.verl["clip_ratio_high"] = 0.3  # type: ignore[index]
    assert derived.verl == dapo.verl and derived.verl is not dapo.verl


# --- peer-exact options -----------------------------------------------------------


def verl_grpo_advantage(scores: torch.Tensor, uids: list[int], eps: float = 1e-6) -> torch.Tensor:
    """verl's outcome advantage as its docs describe it: per-uid loop, unbiased std, a lone
    sample gets mean 0 and std 1 (evaluated in the dtype of ``scores``: pass float64 for
    a reference)."""
    groups: dict[int, list[torch.Tensor]] = {}
    for s, u in zip(scores, uids, strict=True):
        groups.setdefault(u, []).append(s)
    mean, std = {}, {}
    for u, vals in groups.items():
        if len(vals) == 1:
            mean[u], std[u] = scores.new_tensor(0.0), scores.new_tensor(1.0)
        else:
            t = torch.stack(vals)
            mean[u], std[u] = t.mean(), t.std()
    return torch.stack([(s - mean[u]) / (std[u] + eps) for s, u in zip(scores, uids, strict=True)])


@given(st.integers(1, 30), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_group_advantages_reproduce_verl(batch: int, max_id: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    uids = (torch.randint(0, max_id, (batch,), generator=g) * 13).tolist()
    scores = torch.randn(batch, generator=g)
    want = verl_grpo_advantage(scores.double(), uids)
    got = d.group_advantages(scores, torch.tensor(uids), eps=1e-6, singleton="score")
    # denominators: the group std + eps (a lone sample: 1, its advantage its own score)
    lone = torch.tensor([uids.count(u) == 1 for u in uids])
    s = torch.where(lone, 1.0, scale_of(scores, uids, "group", eps=1e-6))
    assert_within(got, want, advantage_bound(scores, want, s), "group advantages")


@pytest.mark.parametrize("eps", [1e-4, 1e-9])
def test_group_advantages_reproduce_trl_and_openrlhf(eps: float) -> None:
    r = torch.randn(8, 6, generator=torch.Generator().manual_seed(3))
    r64 = r.double()
    std = r64.std(1, keepdim=True) + eps
    want = (r64 - r64.mean(1, keepdim=True)) / std
    got = d.group_advantages(r, eps=eps)
    assert_within(got, want, advantage_bound(r, want, std.expand_as(want)), "advantages")


def verl_vanilla_token_mean(
    old: torch.Tensor, logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """verl's vanilla PPO loss (clip_ratio 0.2/0.28, dual clip c=3, log-ratio clamp 20),
    token-mean, as its docs describe it."""
    neg_kl = torch.clamp(logp - old, -20.0, 20.0)
    ratio = torch.exp(neg_kl)
    l1, l2 = -adv * ratio, -adv * torch.clamp(ratio, 0.8, 1.28)
    clip1 = torch.maximum(l1, l2)
    clip2 = torch.min(-adv * 3.0, clip1)
    losses = torch.where(adv < 0, clip2, clip1)
    m = mask.to(losses.dtype)
    return (losses * m).sum() / m.sum()


@given(policy_batches())
def test_loss_reproduces_verl_vanilla_with_dual_clip(b: PolicyBatch) -> None:
    if not bool(b.mask.any()):
        return
    adv = b.advantages[:, None].expand_as(b.logp)
    got = d.token_level_loss(b.logp, b.old_logp, b.advantages, b.mask, dual_clip=3.0)
    # verl's formula evaluated in float64 on the same inputs: the exact value; ours within
    # loss_reference's derived bound of it
    want = verl_vanilla_token_mean(b.old_logp.double(), b.logp.double(), adv.double(), b.mask)
    exact = loss_reference(
        b.logp, b.old_logp, b.advantages, b.mask, dtype=torch.float32, dual_clip=3.0
    )
    assert_within(want, exact.loss, 2 * exact.loss_err, "verl's formula vs the reference")
    assert_within(got, want, 2 * exact.loss_err, "token_level_loss vs verl's formula")


@pytest.mark.parametrize("mode", MODES)
def test_kl_and_sequence_ratio_gradcheck_float64(mode: str) -> None:
    b = make_batch(3, 4, 11, dtype=torch.float64, spread=0.2)
    logp = b.logp.clone().requires_grad_(True)

    def kl(lp: torch.Tensor) -> torch.Tensor:
        return d.token_level_aggregate(d.kl_penalty(lp, b.old_logp, b.mask), b.mask, mode=mode)  # type: ignore[arg-type]

    assert torch.autograd.gradcheck(kl, (logp,))
    assert torch.autograd.gradcheck(
        lambda lp: d.gspo_sequence_ratio(lp, b.old_logp, b.mask), (logp,)
    )


def test_gspo_gradcheck_float64() -> None:
    # GSPO-token's gradient is the derivative of the sequence objective, i.e. of the
    # value aggregated with seq_mean_token_mean (stop-gradients make other aggregations
    # differ on purpose). CISPO's gradient is by design not the derivative of its value
    # (the weight is detached): test_cispo_gradient_is_the_clipped_weight checks it.
    b = make_batch(3, 4, 12, dtype=torch.float64, spread=0.2)
    logp = b.logp.clone().requires_grad_(True)

    def gspo(lp: torch.Tensor) -> torch.Tensor:
        per_token = d.gspo_surrogate(
            lp, b.old_logp, b.advantages, b.mask, eps_low=0.5, eps_high=0.5
        )
        return d.token_level_aggregate(per_token, b.mask, mode="seq_mean_token_mean")

    assert torch.autograd.gradcheck(gspo, (logp,))


def test_trl_loss_types_reproduced_with_a_row_normalizer() -> None:
    # TRL divides its "grpo" and "dr_grpo" losses by all rows, empty (fully masked,
    # e.g. truncated) rows included; dapo_ops counts non-empty rows unless told otherwise.
    b = make_batch(5, 7, 13)
    mask = b.mask.clone()
    mask[2] = False  # a truncated completion, masked out
    # TRL's three normalisations of the per-token loss, evaluated in float64 (exact on the
    # same inputs); ours within loss_reference's derived bound for the matching options
    lp64, old64, adv64 = b.logp.double(), b.old_logp.double(), b.advantages.double()
    per_token = d.clip_higher_surrogate(lp64, old64, adv64, mask)
    m = mask.double()
    rows = mask.shape[0]
    cases = [
        (((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean(),
         {"mode": "seq_mean_token_mean", "normalizer": rows}),
        ((per_token * m).sum() / (5 * 7),
         {"mode": "seq_mean_token_sum_norm", "normalizer": rows, "max_len": 7}),
        ((per_token * m).sum() / m.sum().clamp(min=1.0), {}),
    ]  # fmt: skip
    for trl, options in cases:
        got = d.token_level_loss(b.logp, b.old_logp, b.advantages, mask, **options)
        exact = loss_reference(
            b.logp, b.old_logp, b.advantages, mask, dtype=torch.float32, **options
        )
        assert_within(trl, exact.loss, 2 * exact.loss_err, f"TRL's formula {options}")
        assert_within(got, trl, 2 * exact.loss_err, f"ours {options}")


# --- the peers' numeric guards, as explicit options --------------------------------


def verl_gspo_token_mean(
    logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """verl 0.9.1's ``compute_policy_loss_gspo`` as its source writes it (eps 3e-4/4e-4),
    aggregated with seq-mean-token-mean."""
    m = mask.to(logp.dtype)
    seq_kl = ((logp - old) * m).sum(-1) / m.sum(-1).clamp(min=1)
    log_s = logp - logp.detach() + seq_kl.detach()[:, None]
    s = torch.exp(torch.clamp(log_s, max=10.0))
    a = adv[:, None]
    losses = torch.maximum(-a * s, -a * torch.clamp(s, 1 - 3e-4, 1 + 4e-4))
    return (((losses * m).sum(-1) / m.sum(-1).clamp(min=1))[mask.any(-1)]).mean()


def test_gspo_verl_clamp_reproduces_verl_and_differs_for_large_ratios() -> None:
    b = make_batch(4, 6, 21, dtype=torch.float64)
    mask = b.mask.clone()
    mask[:, 0] = True
    logp, old = b.logp.clone(), b.old_logp.clone()
    old[0] = logp[0] - 12.0  # log s = 12 > 10: verl's clamp acts, and cuts the gradient
    adv = torch.tensor([-1.0, 0.5, -0.3, 2.0], dtype=torch.float64)
    grads = {}
    for name, fn in {
        "verl": lambda lp: verl_gspo_token_mean(lp, old, adv, mask),
        "ours(verl_clamp)": lambda lp: d.policy_loss(
            d.GSPO(verl_clamp=True), lp, old, adv, mask, mode="seq_mean_token_mean"
        ),
        "ours": lambda lp: d.policy_loss(d.GSPO(), lp, old, adv, mask, mode="seq_mean_token_mean"),
    }.items():
        lp = logp.clone().requires_grad_(True)
        value = fn(lp)
        value.backward()
        grads[name] = (value.detach(), lp.grad)
    # Two float64 evaluations of one formula. Per valid token of row i at most K = 30
    # operations and elementary functions (the row's mean log-ratio sums at most seq terms)
    # on the magnitude m_t = |A_i| max(s_i, 1 + eps_high) / (n_i G) (s_i = e^min(log s_i, 10),
    # n_i its tokens, G the non-empty rows): a gradient entry within c = K f + gamma(K + seq)
    # of m_t of the exact one, the loss (a sum over the rows on top) within
    # K f + gamma(K + numel) of sum m_t; so the two evaluations within twice that of each
    # other. Where s_i lies within that of a clip bound, or log s_i of verl's clamp, one
    # may cut the gradient and the other not: there the gradient's bound is the whole m_t.
    dd = torch.where(mask, logp - old, 0.0)
    n_i = mask.sum(-1, keepdim=True)
    log_s = dd.sum(-1, keepdim=True) / n_i
    s = log_s.clamp(max=10.0).exp()
    rows = int(mask.any(-1).sum())
    m_t = torch.where(mask, adv.abs()[:, None] * s.clamp(min=1 + 4e-4) / (n_i * rows), 0.0)
    k, seq = 30, mask.shape[1]
    c = k * func_rel(F64) + gamma(k + seq, F64)
    near = ((s - (1 - 3e-4)).abs() <= 2 * c * s) | ((s - (1 + 4e-4)).abs() <= 2 * c * s)
    near |= (log_s - 10.0).abs() <= 2 * c * (dd.abs().sum(-1, keepdim=True) / n_i + 10.0)
    loss_bound = 2 * (k * func_rel(F64) + gamma(k + mask.numel(), F64)) * float(m_t.sum())
    grad_bound = 2 * c * m_t + torch.where(near & mask, m_t, 0.0)
    assert_within(grads["ours(verl_clamp)"][0], grads["verl"][0], loss_bound, "loss")
    assert_within(grads["ours(verl_clamp)"][1], grads["verl"][1], grad_bound, "gradient")
    assert bool((grads["verl"][1][0] == 0).all())  # verl: no gradient past the clamp
    assert bool((grads["ours"][1][0][mask[0]] != 0).all())  # ours: -A s_i with s_i = e^10


def test_kl_clamp_reproduces_verl_low_var_kl() -> None:
    """verl's ``kl_penalty(..., "low_var_kl")``: k3 of ref - logp, clamped to [-10, 10]."""
    logp = torch.tensor([[-1.0, -8.0, -0.5, -30.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.2, -1.0, -0.5, -1.0]], dtype=torch.float64)
    kl = ref - logp
    verl = torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
    ours = d.kl_penalty(logp, ref, estimator="k3", clamp=10.0)
    # Two float64 evaluations of k3 = e^x - x - 1 (x = ref - logp; clamped: 7 and 29 far
    # past 10, -0.2 and 0 far inside) and of its gradient 1 - e^x (0 past the clamp): a
    # few operations (K = 10) and one exp on magnitudes e^x + |x| + 1, each within
    # c = K f + gamma(K) of the exact value, so within 2 c of each other.
    x = kl.detach()
    mag = x.exp() + x.abs() + 1
    c = 10 * func_rel(F64) + gamma(10, F64)
    assert_within(ours, verl, 2 * c * mag, "low_var_kl value")
    (g_ours,) = torch.autograd.grad(ours.sum(), logp)
    logp2 = logp.detach().clone().requires_grad_(True)
    kl2 = ref - logp2
    (g_verl,) = torch.autograd.grad(torch.clamp(torch.exp(kl2) - kl2 - 1, -10, 10).sum(), logp2)
    assert_within(g_ours, g_verl, 2 * c * mag, "low_var_kl gradient")
    clamped = torch.tensor([[False, True, False, True]])
    assert bool((g_ours[clamped] == 0).all()) and bool((g_verl[clamped] == 0).all())
    assert float(d.kl_penalty(logp.detach(), ref)[0, 1]) > 10  # ours, unclamped by default
    # the fused loss path uses the same value and gradient
    mask = torch.ones_like(logp, dtype=torch.bool)
    adv = torch.zeros(1, dtype=torch.float64)
    kl_value = d.KLPenalty(beta=0.5, clamp=10.0)
    lp = logp.detach().clone().requires_grad_(True)
    loss = d.policy_loss(d.ClipHigher(), lp, ref, adv, mask, ref_logp=ref, kl=kl_value)
    loss.backward()
    # the same per-token terms (A = 0: the policy term is exactly 0), times beta, over the
    # 4 tokens: gamma(K + 4) more for the sum of 4 terms and the scalings
    c_sum = 10 * func_rel(F64) + gamma(10 + 4, F64)
    assert_within(loss, 0.5 * verl.mean(), 2 * c_sum * 0.5 * float(mag.sum()) / 4, "loss")
    assert lp.grad is not None
    assert_within(lp.grad, 0.5 * g_verl / 4, 2 * c_sum * 0.5 * mag / 4, "loss gradient")


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "abs"])
@pytest.mark.parametrize("clamp", [None, 0.05])
@pytest.mark.parametrize("with_is", [False, True])
@pytest.mark.parametrize("straight_through", [False, True])
def test_fused_kl_and_is_weights_equal_the_composition(
    estimator: str, clamp: float | None, with_is: bool, straight_through: bool
) -> None:
    """The fused path's analytic KL gradient (every estimator, with and without the
    clamp) and IS weights against autograd through the composition, in float64."""
    b = make_batch(5, 9, 22, dtype=torch.float64, spread=0.4)
    ref = b.old_logp - torch.rand(5, 9, dtype=torch.float64)
    w = torch.rand(5, 9, dtype=torch.float64) * 2 if with_is else None
    kl = d.KLPenalty(beta=0.3, estimator=estimator, clamp=clamp, straight_through=straight_through)  # type: ignore[arg-type]
    for mode in MODES:
        lp_f = b.logp.clone().requires_grad_(True)
        lp_r = b.logp.clone().requires_grad_(True)
        fused = d.policy_loss(
            d.ClipHigher(), lp_f, b.old_logp, b.advantages, b.mask, mode=mode,  # type: ignore[arg-type]
            ref_logp=ref, kl=kl, is_weights=w,
        )  # fmt: skip
        per_token = d.clip_higher_surrogate(lp_r, b.old_logp, b.advantages, b.mask)
        if w is not None:
            per_token = per_token * w
        kl_r = d.kl_penalty(
            lp_r,
            ref,
            b.mask,
            estimator=estimator,
            clamp=clamp,
            straight_through=straight_through,  # type: ignore[arg-type]
        )
        want = d.token_level_aggregate(per_token + 0.3 * kl_r, b.mask, mode=mode)  # type: ignore[arg-type]
        fused.backward()
        want.backward()
        # Two float64 evaluations of the same per-token formula (at most K = 30 operations
        # and elementary functions on magnitudes |A| r w + beta (e^x + |x| + 1 + x^2)),
        # aggregated with weights a_t: each within (K f + gamma(K + n)) sum a_t mag_t of the
        # exact value, per-token gradients within 2 (K f + gamma(K)) a_t mag_t of each other
        x = ref - b.logp
        r = (b.logp - b.old_logp).exp()
        mag = b.advantages.abs()[:, None] * r * (1.0 if w is None else w)
        mag = torch.where(b.mask, mag + 0.3 * (x.exp() + x.abs() + 1 + x.square()), 0.0)
        ones = torch.ones_like(mag, requires_grad=True)
        (a_t,) = torch.autograd.grad(d.token_level_aggregate(ones, b.mask, mode=mode), ones)  # type: ignore[arg-type]
        k, n = 30, b.logp.numel()
        loss_bound = 2 * (k * func_rel(F64) + gamma(k + n, F64)) * float((a_t * mag).sum())
        assert_within(fused, want, loss_bound, f"{mode} loss")
        assert lp_f.grad is not None and lp_r.grad is not None
        grad_bound = 2 * (k * func_rel(F64) + gamma(k, F64)) * a_t * mag
        assert_within(lp_f.grad, lp_r.grad, grad_bound, f"{mode} gradient")


# --- rollout correction -------------------------------------------------------------


@given(
    policy_batches(),
    st.sampled_from(["k1", "k2", "k3"]),
    st.sampled_from(["token", "seq_sum", "seq_mean", "seq_max"]),
)
def test_rejection_mask_properties(b: PolicyBatch, statistic: str, level: str) -> None:
    if statistic == "k1" and level == "seq_max":
        with pytest.raises(d.InputError, match="seq_max"):
            d.rejection_mask(b.old_logp, b.logp, b.mask, statistic="k1", level="seq_max", upper=2.0)
        return
    upper = 1.5 if statistic == "k1" else 0.05
    keep = d.rejection_mask(
        b.old_logp, b.logp, b.mask, statistic=statistic, level=level, upper=upper
    )  # type: ignore[arg-type]
    assert keep.dtype == torch.bool and bool((keep <= b.mask).all())  # a subset of the mask
    if level != "token":  # whole sequences: kept entirely or not at all
        partial = (keep != b.mask) & keep.any(dim=-1, keepdim=True)
        assert not bool(partial.any())
    # the same policy on both sides keeps everything
    same = d.rejection_mask(
        b.old_logp, b.old_logp, b.mask, statistic=statistic, level=level, upper=upper
    )  # type: ignore[arg-type]
    assert torch.equal(same, b.mask)
    # garbage in masked positions changes nothing
    junk = torch.where(b.mask, b.logp, torch.tensor(float("nan")))
    dirty = d.rejection_mask(
        b.old_logp, junk, b.mask, statistic=statistic, level=level, upper=upper
    )  # type: ignore[arg-type]
    assert torch.equal(dirty, keep)


@given(policy_batches(), st.sampled_from(["token", "sequence"]))
def test_is_weights_two_sided_and_batch_normalized(b: PolicyBatch, level: str) -> None:
    w = d.truncated_is_weights(b.old_logp, b.logp, b.mask, level=level, cap=2.0, lower=0.5)  # type: ignore[arg-type]
    raw = d.truncated_is_weights(b.old_logp, b.logp, b.mask, level=level, cap=1e30)  # type: ignore[arg-type]
    inside = (raw >= 0.5) & (raw <= 2.0)
    assert torch.equal(w, torch.where(inside, raw, 0.0))
    n = d.truncated_is_weights(b.old_logp, b.logp, b.mask, level=level, batch_normalize=True)  # type: ignore[arg-type]
    plain = d.truncated_is_weights(b.old_logp, b.logp, b.mask, level=level)  # type: ignore[arg-type]
    if level == "token" and bool(b.mask.any()) and float(plain[b.mask].double().mean()) > 1e-8:
        # n_i = fl(w_i / m), m = fl(fl(sum w) / N) over the N valid tokens (positive w;
        # the zeros at masked positions add exactly): the float64 mean of the n_i is
        # sum w_i (1 + d_i) / sum w_j (1 + t_j), each factor a quotient of at most N + 1
        # roundings, so within gamma(N + 1) of 1, plus the float64 mean's own gamma(N)
        count = int(b.mask.sum())
        mean = n[b.mask].double().mean()
        assert_within(mean, torch.tensor(1.0, dtype=F64), gamma_ref(count + 2, torch.float32))


def test_rollout_correction_bad_options_name_the_argument() -> None:
    b = make_batch(2, 3, 0)
    for kwargs, name in [
        ({"upper": 0.0}, "upper"),
        ({"upper": 2.0, "lower": 3.0}, "lower"),
        ({"upper": 2.0, "statistic": "k2", "lower": 0.5}, "lower"),
        ({"upper": 2.0, "statistic": "k4"}, "statistic"),
        ({"upper": 2.0, "level": "sequence"}, "level"),
    ]:
        with pytest.raises(ValueError, match=name):
            d.rejection_mask(b.old_logp, b.logp, b.mask, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lower"):
        d.truncated_is_weights(b.old_logp, b.logp, b.mask, cap=2.0, lower=3.0)


@given(policy_batches())
def test_offpolicy_metrics_vanish_on_policy(b: PolicyBatch) -> None:
    m = d.offpolicy_metrics(b.old_logp, b.old_logp, b.mask, is_weights=b.mask.float())
    for name in ("kl", "k3_kl", "log_ppl_diff", "log_ppl_abs_diff", "chi2_token", "chi2_seq"):
        assert float(getattr(m, name)) == 0.0, name
    assert float(m.is_ess) == 1.0
    assert float(m.ppl_ratio) == (1.0 if bool(b.mask.any()) else 0.0)
