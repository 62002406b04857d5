"""varbench.integrations.measure (no peer needed): builder counts, the cancellation residual,
the split-group sketched variance against the exact one, the proxy correlation, records that
the report writer renders."""

from __future__ import annotations

import pytest
import torch

from varbench.integrations import measure_groups, records_result
from varbench.models import build_preset
from varbench.models.logits import token_logprobs
from varbench.report import write_report

pytestmark = pytest.mark.usefixtures("one_thread")


def _batch(seed=0, P=4, G=3, Lp=3, T=5):
    gen = torch.Generator().manual_seed(seed)
    B = P * G
    prompt = torch.randint(4, 30, (B, Lp), generator=gen)
    comp = torch.randint(4, 30, (B, T), generator=gen)
    comp[0:3, 0] = 7  # group 0 shares its first step
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    cmask = (torch.arange(T) < lengths[:, None]).long()
    R = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 2.0, 1.0, 0.5, 0.5, 0.0])
    return prompt, torch.ones(B, Lp, dtype=torch.long), comp, cmask, R


def test_builder_counts_and_cancellation_known_answers():
    _, _, comp, cmask, R = _batch()
    recs = measure_groups(step=5, rewards=R, completion_ids=comp, completion_mask=cmask, G=3,
                          measures=("counts", "cancellation"))
    by = {r["metric"]: r for r in recs}
    assert by["groups"]["value"] == 4 and by["all_agree_groups"]["value"] == 1
    assert by["nonzero_raw"]["value"] == 8 and by["nonzero_centered"]["value"] == 8
    # group 0 shares step t = 0 with A = R - mean = (2/3, -1/3, -1/3): residual exactly 0
    assert by["cancellation_residual"]["value"] == pytest.approx(0.0, abs=1e-12)
    assert all(r["step"] == 5 for r in recs)


def _flat_grad(model, ids, attn, start, cmask, adv) -> torch.Tensor:
    """Reference: the flat float64 gradient of the token-mean surrogate, by .backward()."""
    model.zero_grad(set_to_none=True)
    logp = token_logprobs(model(input_ids=ids, attention_mask=attn).logits.double(), ids)
    m = cmask.double()
    ((adv.double()[:, None] * logp[:, start:] * m).sum() / m.sum()).backward()
    g = torch.cat([p.grad.double().reshape(-1) for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return g


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_split_variance_is_the_exact_half_difference(dtype):
    """No probes: the record is ||g_1 - g_2||^2 / 4 of the two halves' gradients, leaving
    the model's .grad untouched."""
    model = build_preset("micro", seed=0, dtype=dtype).model
    prompt, pmask, comp, cmask, R = _batch(1)
    adv = R - R.reshape(4, 3).mean(1).repeat_interleave(3)
    rec = measure_groups(step=0, rewards=R, completion_ids=comp, completion_mask=cmask,
                         advantages=adv, model=model, prompt_ids=prompt, prompt_mask=pmask,
                         G=3, measures=("variance",))[0]
    assert all(p.grad is None for p in model.parameters())
    ids = torch.cat([prompt, comp], 1)
    attn = torch.cat([pmask, cmask], 1)
    g = [_flat_grad(model, ids[h], attn[h], 3, cmask[h], adv[h])
         for h in (slice(0, 6), slice(6, 12))]
    exact = float(((g[0] - g[1]) ** 2).sum() / 4)
    assert exact > 0 and rec["n"] == 4
    # float32 logits vs the reference's float64 ones: float32 rounding only
    assert rec["value"] == pytest.approx(exact, rel=1e-5 if dtype == torch.float32 else 1e-12)


def test_proxy_correlation_and_report(tmp_path):
    policy = build_preset("micro", seed=0)
    prompt, pmask, comp, cmask, R = _batch(2)
    recs = measure_groups(step=1, rewards=R, completion_ids=comp, completion_mask=cmask,
                          model=policy.model, prompt_ids=prompt, prompt_mask=pmask, G=3,
                          proxy_rows=4)
    by = {r["metric"]: r for r in recs}
    assert -1 <= by["proxy_exact_corr"]["value"] <= 1 and by["proxy_exact_corr"]["n"] >= 3
    res = records_result(recs, name="unit run", source="test")
    out = write_report([res], tmp_path)
    assert "proxy_exact_corr" in (out / "report.md").read_text()


def test_proxy_sequence_record_against_a_per_row_autograd_loop():
    """proxy_seq_scale and proxy_seq_spearman from exact per-sequence norms equal those from
    a Python loop of one autograd backward per row (float64 model)."""
    from scipy.stats import spearmanr

    from varbench.grads.stats import forward_stats

    model = build_preset("micro", seed=0, dtype=torch.float64).model
    prompt, pmask, comp, cmask, R = _batch(3)
    recs = measure_groups(step=2, rewards=R, completion_ids=comp, completion_mask=cmask,
                          model=model, prompt_ids=prompt, prompt_mask=pmask, G=3,
                          measures=("proxy_seq",))
    by = {r["metric"]: r for r in recs}
    ids = torch.cat([prompt, comp], 1)
    attn = torch.cat([pmask, cmask], 1)
    exact = []
    for b in range(ids.shape[0]):
        logp = token_logprobs(model(input_ids=ids[b:b + 1], attention_mask=attn[b:b + 1])
                              .logits, ids[b:b + 1])[:, 3:]
        g = torch.autograd.grad((logp * cmask[b:b + 1]).sum(), list(model.parameters()))
        exact.append(float(sum((x ** 2).sum() for x in g)))
    resp = torch.cat([torch.zeros_like(pmask), cmask], 1)
    proxy = forward_stats(model, ids, resp, attn).proxy.sum(1).numpy()
    exact = torch.tensor(exact).numpy()
    assert by["proxy_seq_scale"]["value"] == pytest.approx(exact.mean() / proxy.mean(), rel=1e-9)
    assert by["proxy_seq_spearman"]["value"] == pytest.approx(spearmanr(proxy, exact).statistic)
    assert by["proxy_seq_spearman"]["n"] == 12
