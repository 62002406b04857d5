"""varbench against the real verl 0.9.1 (the ``peers`` extra): advantages, agg_loss, policy
losses, KL, and varbench's estimators registered in verl and run by verl's compute_advantage.

Every row of docs/peers.md for verl is one test here. Batches: groups of sizes 1-5 shuffled,
ties, an all-equal group, empty rows and padding (tests/_fixtures_peers.py), float32 and float64.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _fixtures_peers import TOL, TOL_SUMS, rel_diff, require, verl_batch

import varbench.estimators as E
from varbench._util.checks import UsageError

core = require("verl.trainer.ppo.core_algos")
from verl.trainer.config import AlgoConfig  # noqa: E402
from verl.workers.config import FSDPActorConfig  # noqa: E402

DTYPES = [torch.float32, torch.float64]
SEEDS = [0, 1, 2]


def _case(seed, dtype):
    b = verl_batch(seed, dtype)
    return b, {"token_level_rewards": b["tok"].clone(), "response_mask": b["mask"],
               "index": b["index"]}


# ---- advantages ------------------------------------------------------------------------------

ADVANTAGES = [  # (verl function, its keywords, varbench scheme, to_flat keywords)
    ("compute_grpo_outcome_advantage", {}, "normalized", {}),
    ("compute_grpo_outcome_advantage", {"norm_adv_by_std_in_grpo": False}, "normalized", {}),
    ("compute_grpo_outcome_advantage", {"epsilon": 0.5}, "normalized", {}),
    ("compute_rloo_outcome_advantage", {}, "rloo", {}),
    ("compute_opo_outcome_advantage", {}, "opo", {}),
    ("compute_reinforce_plus_plus_baseline_outcome_advantage", {}, "reinforce_pp_baseline", {}),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("row", ADVANTAGES, ids=lambda r: f"{r[0]}{r[1] or ''}")
def test_group_advantages_match_verl(row, seed, dtype):
    name, kw, scheme, ours = row
    b, args = _case(seed, dtype)
    want, want_ret = getattr(core, name)(**args, **kw)
    got, ret = E.to_flat(scheme, **ours)(b["tok"], b["mask"], b["index"], **kw)
    assert rel_diff(got, want) <= TOL[dtype]
    assert rel_diff(ret, want_ret) <= TOL[dtype]


def test_normalized_float32_is_no_less_accurate_than_verl():
    """In float32 GRPO's (R - mu) / sigma loses ~ulp(R) / sigma where a group's rewards are close;
    varbench centres on the group minimum (exact), verl on the mean. Against verl's float64
    result, varbench's float32 error never exceeds verl's own float32 error (+ 4.8e-7)."""
    for seed in range(10):
        b64 = verl_batch(seed, torch.float64)
        truth, _ = core.compute_grpo_outcome_advantage(b64["tok"].clone(), b64["mask"],
                                                       b64["index"])
        b = {k: v.float() if isinstance(v, torch.Tensor) else v for k, v in b64.items()}
        theirs, _ = core.compute_grpo_outcome_advantage(b["tok"].clone(), b["mask"], b["index"])
        ours, _ = E.to_flat("normalized")(b["tok"], b["mask"], b["index"])
        assert rel_diff(ours, truth) <= rel_diff(theirs, truth) + 4.8e-7


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("hzt", [True, False])
@pytest.mark.parametrize("rho", [False, True])
def test_otb_matches_verl(seed, dtype, hzt, rho):
    b, args = _case(seed, dtype)
    stats = {"old_log_probs": b["logp"], "sum_pi_squared": b["sum_pi_sq"],
             "rollout_is_weights": b["is_w"] if rho else None}
    want, want_ret = core.compute_optimal_token_baseline_advantage(
        **args, **stats, handle_zero_tail=hzt)
    if not rho:
        stats.pop("rollout_is_weights")
    got, ret = E.to_flat("otb")(b["tok"], b["mask"], b["index"], **stats,
                                handle_zero_tail=hzt)
    assert rel_diff(got, want) <= TOL_SUMS[dtype]
    assert rel_diff(ret, want_ret) <= TOL[dtype]  # verl's second value: the reward-to-go


def _multi_turn(seed, dtype):
    """A verl batch whose responses have holes (tool tokens under mask 0), reward on the last
    valid token: ``(tok, mask, index, stats)``."""
    b = verl_batch(seed, torch.float64, empty=False)
    B, T = b["mask"].shape
    gen = torch.Generator().manual_seed(100 + seed)
    mask = b["mask"] * (torch.rand(B, T, generator=gen) >= 0.3)
    mask[:, 0] = b["mask"][:, 0]
    last = T - 1 - mask.flip(-1).argmax(-1)
    tok = torch.zeros(B, T, dtype=torch.float64).scatter_(1, last[:, None], b["R"][:, None])
    stats = {"old_log_probs": b["logp"].to(dtype), "sum_pi_squared": b["sum_pi_sq"].to(dtype)}
    return tok.to(dtype), mask.to(dtype), b["index"], stats


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("hzt", [True, False])
def test_otb_on_multi_turn_masks_matches_both_verl_variants(seed, dtype, hzt):
    """Holes in the masks: to_flat("otb") (conventions "verl") = verl's optimal_token_baseline
    (columns aligned, its zero tail from the second-longest count); conventions "varbench"
    (responses compacted to their generated tokens) = verl's tir_optimal_token_baseline, the
    group of one response apart (varbench's G = 1 convention gives it 0, verl R)."""
    tok, mask, index, stats = _multi_turn(seed, dtype)
    plain, _ = core.compute_optimal_token_baseline_advantage(tok, mask, index, **stats,
                                                             handle_zero_tail=hzt)
    tir, _ = core.compute_multi_turn_optimal_token_baseline_advantage(tok, mask, index, **stats,
                                                                      handle_zero_tail=hzt)
    assert rel_diff(plain, tir) > 0.1  # the two verl estimators differ on these masks
    got, _ = E.to_flat("otb")(tok, mask, index, **stats, handle_zero_tail=hzt)
    assert rel_diff(got, plain) <= TOL_SUMS[dtype]
    ours, _ = E.to_flat("otb", conventions="varbench")(tok, mask, index, **stats,
                                                        handle_zero_tail=hzt)
    ids = np.asarray(index)
    multi = torch.as_tensor([int((ids == g).sum()) > 1 for g in ids])
    # verl's tir sums W over up to G*T compacted terms in another order than varbench
    assert rel_diff(ours[multi], tir[multi]) <= (1e-8 if dtype == torch.float64 else 4.8e-7)
    assert rel_diff(ours[multi], plain[multi]) > 0.1


def test_options_verl_passes_are_read_not_dropped():
    """The two options the issue saw silently dropped now change the result as in verl."""
    b, args = _case(0, torch.float64)
    fn = E.to_flat("normalized")
    for kw in ({"epsilon": 0.5}, {"norm_adv_by_std_in_grpo": False}):
        want, _ = core.compute_grpo_outcome_advantage(**args, **kw)
        plain, _ = fn(b["tok"], b["mask"], b["index"])
        got, _ = fn(b["tok"], b["mask"], b["index"], **kw)
        assert rel_diff(got, want) <= 1e-15 and rel_diff(plain, want) > 0.1
    cfg = AlgoConfig(norm_adv_by_std_in_grpo=False)
    want, _ = core.compute_grpo_outcome_advantage(**args, norm_adv_by_std_in_grpo=False)
    got, _ = fn(b["tok"], b["mask"], b["index"], config=cfg)
    assert rel_diff(got, want) <= 1e-15
    with pytest.raises(TypeError, match="epsilon=0.5 has no meaning for scheme 'rloo'"):
        E.to_flat("rloo")(b["tok"], b["mask"], b["index"], epsilon=0.5)
    E.to_flat("rloo", ignore=("epsilon",))(b["tok"], b["mask"], b["index"], epsilon=0.5)


# ---- registered in verl, run by verl's own compute_advantage ---------------------------------


def _data_proto(b):
    from verl import DataProto

    return DataProto.from_dict(
        tensors={"token_level_rewards": b["tok"].clone(), "response_mask": b["mask"],
                 "old_log_probs": b["logp"], "sum_pi_squared": b["sum_pi_sq"]},
        non_tensors={"uid": b["index"].astype(object)},
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_compute_advantage_runs_varbench_estimators_registered_in_verl(dtype):
    from verl.trainer.ppo.ray_trainer import compute_advantage

    b = verl_batch(4, dtype)
    cfg = AlgoConfig(adv_estimator="vb_normalized", norm_adv_by_std_in_grpo=True)
    mine = {"vb_rloo": "rloo", "vb_normalized": "normalized"}
    for name, scheme in mine.items():
        if name not in core.ADV_ESTIMATOR_REGISTRY:
            core.register_adv_est(name)(E.to_flat(scheme))
    pairs = [("vb_rloo", "rloo", cfg), ("vb_normalized", "grpo", cfg),
             ("vb_normalized", "grpo",
              AlgoConfig(adv_estimator="vb_normalized", norm_adv_by_std_in_grpo=False))]
    for ours, theirs, config in pairs:
        got = compute_advantage(_data_proto(b), ours, config=config)
        want = compute_advantage(_data_proto(b), theirs, config=config,
                                 norm_adv_by_std_in_grpo=config.norm_adv_by_std_in_grpo)
        assert rel_diff(got.batch["advantages"], want.batch["advantages"]) <= TOL[dtype]
    # OTB: verl hands the token statistics only to its OTB name, so varbench's otb replaces
    # verl's there (and verl's is put back afterwards).
    theirs = core.ADV_ESTIMATOR_REGISTRY["optimal_token_baseline"]
    want = compute_advantage(_data_proto(b), "optimal_token_baseline", config=cfg)
    core.ADV_ESTIMATOR_REGISTRY.pop("optimal_token_baseline")
    try:
        core.register_adv_est("optimal_token_baseline")(E.to_flat("otb"))
        got = compute_advantage(_data_proto(b), "optimal_token_baseline", config=cfg)
    finally:
        core.ADV_ESTIMATOR_REGISTRY["optimal_token_baseline"] = theirs
    for key in ("advantages", "returns"):
        assert rel_diff(got.batch[key], want.batch[key]) <= TOL_SUMS[dtype]


def test_check_estimator_runs_verl_otb_with_token_statistics():
    """check_estimator hands logprobs/sum_pi_sq to verl's OTB under verl's names: every contract
    row passes and the whole table equals varbench's own otb's (OTB keeps the sample in its own
    baseline, so both fail the rescaled-bias row alike: a property of OTB, not of the adapter)."""
    from varbench.testing import check_estimator

    theirs = check_estimator(core.compute_optimal_token_baseline_advantage, num_steps=400)
    ours = check_estimator("otb", num_steps=400)
    contract = theirs.table[theirs.table["check"].str.match("shape|perm|masked|all-agree|edge")]
    assert len(contract) >= 8 and contract["passed"].all(), theirs
    np.testing.assert_allclose(theirs.table["value"].astype(float),
                               ours.table["value"].astype(float), rtol=1e-5, atol=1e-6)
    assert list(theirs.table["passed"]) == list(ours.table["passed"])
    # OTB's O(1/G) bias is by construction (docs/science.md); a user who accepts it says how
    # much, and then every required row passes on verl's own OTB
    bias = float(theirs.table.set_index("check").loc["bias (rescaled)", "value"])
    assert bias > 0.05
    accepted = check_estimator(core.compute_optimal_token_baseline_advantage, num_steps=400,
                               tolerance=1.5 * bias)
    assert accepted.passed, accepted


# ---- aggregation, policy losses, KL ----------------------------------------------------------

MODES = list(E.AGGREGATION_MODES)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_matches_verl(mode, dtype):
    for seed in SEEDS:
        b = verl_batch(seed, dtype)
        loss_mat = torch.randn(b["mask"].shape, dtype=dtype, generator=torch.Generator()
                               .manual_seed(seed))
        want = core.agg_loss(loss_mat, b["mask"], mode)
        w = E.aggregation_weights(b["mask"], mode, conventions="verl", dtype=dtype)
        assert rel_diff((w * loss_mat).sum(), want) <= TOL[dtype]
    if mode != "token-mean":  # verl leaves empty rows out of the count, varbench's default not
        plain = (E.aggregation_weights(b["mask"], mode, dtype=dtype) * loss_mat).sum()
        assert rel_diff(plain, want) > 1e-4


def _loss_inputs(seed, dtype, token_adv=False):
    b = verl_batch(seed, dtype)
    gen = torch.Generator().manual_seed(100 + seed)
    old = b["logp"]
    logp = (old + torch.randn(old.shape, generator=gen, dtype=dtype) * 0.8 * b["mask"])
    if token_adv:
        adv, _ = E.to_flat("otb")(b["tok"], b["mask"], b["index"], old_log_probs=old,
                                  sum_pi_squared=b["sum_pi_sq"])
    else:
        adv = torch.randn(old.shape[0], 1, generator=gen, dtype=dtype) * 2 * b["mask"]
    return b, old, logp, adv


def _actor(**kw):
    return FSDPActorConfig(strategy="fsdp", rollout_n=4, ppo_micro_batch_size_per_gpu=1, **kw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_vanilla_policy_loss_with_dual_clip_matches_verl(mode, dtype):
    for seed in SEEDS:
        b, old, logp, adv = _loss_inputs(seed, dtype)
        lp1, lp2 = logp.clone().requires_grad_(), logp.clone().requires_grad_()
        cfg = _actor(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
        want, _ = core.compute_policy_loss_vanilla(old, lp1, adv, b["mask"], mode, config=cfg)
        got, metrics = E.policy_loss(lp2, old, adv, b["mask"], mode, clip=(0.2, 0.28),
                                     clip_ratio_c=3.0, conventions="verl")
        assert rel_diff(got, want) <= TOL[dtype]
        want.backward()
        got.backward()
        assert rel_diff(lp2.grad, lp1.grad) <= TOL[dtype]
    assert float(metrics["clip_frac_lower"]) > 0  # the dual clip really bites in these batches
    without, _ = E.policy_loss(logp, old, adv, b["mask"], mode, clip=(0.2, 0.28),
                               conventions="verl")
    assert rel_diff(without, want) > 1e-3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_gspo_token_loss_and_gradients_match_verl(mode, dtype):
    for seed in SEEDS:
        b, old, _, adv = _loss_inputs(seed, dtype, token_adv=True)
        logp = old + 0.05 * torch.randn(old.shape, dtype=dtype,
                                        generator=torch.Generator().manual_seed(seed)) * b["mask"]
        lp1, lp2, lp3 = (logp.clone().requires_grad_() for _ in range(3))
        cfg = _actor(clip_ratio=0.2, clip_ratio_low=3e-4, clip_ratio_high=4e-4)
        want, _ = core.compute_policy_loss_gspo(old, lp1, adv, b["mask"], mode, config=cfg)
        got, _ = E.policy_loss(lp2, old, adv, b["mask"], mode, clip=(3e-4, 4e-4),
                               ratio="sequence-token", conventions="verl")
        seq, _ = E.policy_loss(lp3, old, adv, b["mask"], mode, clip=(3e-4, 4e-4),
                               ratio="sequence", conventions="verl")
        assert rel_diff(got, want) <= TOL[dtype] and rel_diff(seq, want) <= TOL[dtype]
        for loss in (want, got, seq):
            loss.backward()
        assert rel_diff(lp2.grad, lp1.grad) <= TOL[dtype]
        coef = E.token_coefficients(logp, old, adv, b["mask"], mode, clip=(3e-4, 4e-4),
                                    ratio="sequence-token", conventions="verl")
        assert rel_diff(coef, lp1.grad) <= TOL[dtype]
    assert rel_diff(lp3.grad, lp1.grad) > 1e-3  # GSPO (no stop-gradient) differs with token A


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_penalty_matches_verl(kind, dtype):
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(40, 9, generator=gen, dtype=dtype) * 4
    ref = -torch.rand(40, 9, generator=gen, dtype=dtype) * 4
    ref[0, :3] = torch.tensor([-40.0, 10.0, -15.0], dtype=dtype)  # where the clamps bite
    want = core.kl_penalty(logp, ref, kind)
    got = E.kl_penalty(logp, ref, kind, clamp=kind == "k3")
    assert rel_diff(got, want) <= TOL[dtype]
    if kind == "k3":
        assert rel_diff(E.kl_penalty(logp, ref, kind), want) > 1


def _actor_batch(seed: int = 0, relabel=None):
    """A DataProto as verl's trainer holds it after compute_advantage: 4 groups of 4 rows
    shuffled, multi-turn response masks (tool tokens attended, not trained), GRPO advantages
    computed by verl itself; ``relabel`` maps each uid string to another."""
    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import compute_advantage

    gen = torch.Generator().manual_seed(seed)
    B, Lp, T = 16, 3, 6
    uid = np.array([f"u{g}" for g in np.repeat(np.arange(4), 4)], dtype=object)
    uid = uid[torch.randperm(B, generator=gen).numpy()]
    if relabel is not None:
        uid = np.array([relabel(u) for u in uid], dtype=object)
    lengths = torch.randint(2, T + 1, (B,), generator=gen)
    attn_resp = (torch.arange(T) < lengths[:, None]).long()
    mask = attn_resp.clone()
    mask[:, 1] = 0  # a tool token in every response: attended, not trained
    R = torch.randint(0, 3, (B,), generator=gen).float()
    last = T - 1 - mask.flip(-1).argmax(-1)
    tok = torch.zeros(B, T).scatter_(1, last[:, None], R[:, None])
    data = DataProto.from_dict(
        tensors={"token_level_rewards": tok, "response_mask": mask.float(),
                 "prompts": torch.randint(4, 30, (B, Lp), generator=gen),
                 "responses": torch.randint(4, 30, (B, T), generator=gen),
                 "attention_mask": torch.cat([torch.ones(B, Lp, dtype=torch.long), attn_resp],
                                             1)},
        non_tensors={"uid": uid})
    return compute_advantage(data, "grpo", config=AlgoConfig(adv_estimator="grpo"))


def _split_variance_by_hand(model, data) -> float:
    """||g_1 - g_2||^2 / 4 with the batch's own advantages, halves = the first / last two
    groups by first appearance of their uid, attention as the batch gives it (float64)."""
    from varbench.models.logits import token_logprobs

    uid = list(data.non_tensor_batch["uid"])
    seen = list(dict.fromkeys(uid))
    t = data.batch
    ids = torch.cat([t["prompts"], t["responses"]], 1)
    Lp = t["prompts"].shape[1]
    grads = []
    for half in (seen[:2], seen[2:]):
        rows = torch.tensor([i for i, u in enumerate(uid) if u in half])
        logp = token_logprobs(model(input_ids=ids[rows],
                                    attention_mask=t["attention_mask"][rows]).logits,
                              ids[rows])[:, Lp:]
        m = t["response_mask"][rows].double()
        loss = (t["advantages"][rows].double() * logp * m).sum() / m.sum()
        grads.append(torch.autograd.grad(loss, list(model.parameters())))
    return sum(float(((a - b) ** 2).sum()) for a, b in zip(*grads, strict=True)) / 4


def test_batch_records_measure_the_dataproto_verl_holds(tmp_path):
    """A DataProto straight from verl's compute_advantage: its advantages, its attention mask
    (tool tokens attended) and its uids in order of first appearance; the split variance
    equals a by-hand float64 computation, relabelled uids change nothing, and advantages
    scaled by 3 scale the variance by 9."""
    from varbench.grads import exact_float64
    from varbench.integrations.verl import batch_records, records_result
    from varbench.models import build_preset
    from varbench.report import write_report

    model = exact_float64(build_preset("micro", seed=0).model)  # float64 norms too
    data = _actor_batch()
    recs = batch_records(data, step=3, model=model, proxy_rows=4)
    by = {r["metric"]: r["value"] for r in recs}
    assert by["groups"] == 4 and by["responses"] == 16
    assert by["grad_var_split"] == pytest.approx(_split_variance_by_hand(model, data), rel=1e-10)
    assert {"proxy_seq_spearman", "proxy_seq_scale", "proxy_exact_corr"} <= set(by)
    flipped = _actor_batch(relabel=lambda u: "z" + str(9 - int(u[1:])))
    assert batch_records(flipped, step=3, model=model, proxy_rows=4) == recs
    data.batch["advantages"] = data.batch["advantages"].double() * 3  # exact in float64
    by3 = {r["metric"]: r["value"] for r in batch_records(data, step=3, model=model)}
    assert by3["grad_var_split"] == pytest.approx(9 * by["grad_var_split"], rel=1e-10)
    out = write_report([records_result(recs, name="verl batch", source="verl")], tmp_path)
    assert "grad_var_split" in (out / "report.md").read_text()


def test_verl_integration_records_over_a_dataproto_batch(tmp_path):
    """The mixed-size batch (groups of 1 to 5, empty responses) as a mapping of DataProto's
    keys: counts and records that render."""
    from varbench.integrations.verl import batch_records, records_result
    from varbench.models import build_preset
    from varbench.report import write_report

    b = verl_batch(0, torch.float32)
    B, T = b["mask"].shape
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(4, 30, (B, 3), generator=gen)
    responses = torch.randint(4, 30, (B, T), generator=gen)
    data = _data_proto(b)
    data.batch["prompts"], data.batch["responses"] = prompts, responses
    data.batch["attention_mask"] = torch.cat([torch.ones(B, 3, dtype=torch.long),
                                              b["mask"].long()], 1)
    batch = {**{k: data.batch[k] for k in data.batch.keys()}, "uid": data.non_tensor_batch["uid"]}
    records = batch_records(batch, step=3, model=build_preset("micro", seed=0).model,
                            proxy_rows=4)
    assert records == batch_records(data, step=3, model=build_preset("micro", seed=0).model,
                                    proxy_rows=4)
    by = {r["metric"]: r for r in records}
    assert by["all_agree_groups"]["value"] == 2  # the all-equal group and the G = 1 group
    assert by["groups"]["value"] == 7 and all(r["step"] == 3 for r in records)
    assert by["grad_var_split"]["value"] >= 0 and -1 <= by["proxy_exact_corr"]["value"] <= 1
    out = write_report([records_result(records, name="verl batch", source="verl")], tmp_path)
    assert "all_agree_groups" in (out / "report.md").read_text()
    with pytest.raises(UsageError, match="no 'uid'"):
        batch_records({k: v for k, v in batch.items() if k != "uid"}, step=0)


def test_verl_variance_proxy_against_exact_norms():
    """verl's own variance_proxy/proxy2_total_power of a batch beside the exact total power
    mean_b ||sum_t A grad log pi||^2 (a per-row autograd loop here), their scale and rank."""
    from varbench.grads.stats import forward_stats
    from varbench.integrations.verl import verl_proxy_records
    from varbench.models import build_preset
    from varbench.models.logits import token_logprobs

    model = build_preset("micro", seed=0, dtype=torch.float64).model
    data = _actor_batch(1)
    t = data.batch
    ids = torch.cat([t["prompts"], t["responses"]], 1)
    Lp = t["prompts"].shape[1]
    resp = torch.cat([torch.zeros_like(t["prompts"]), t["response_mask"].long()], 1)
    st = forward_stats(model, ids, resp, t["attention_mask"])
    t["old_log_probs"], t["sum_pi_squared"] = st.logp[:, Lp:].float(), st.sum_pi_sq[:, Lp:].float()
    recs = {r["metric"]: r["value"] for r in verl_proxy_records(data, model, step=0)}
    exact = []
    for b in range(ids.shape[0]):
        logp = token_logprobs(model(input_ids=ids[b:b + 1],
                                    attention_mask=t["attention_mask"][b:b + 1]).logits,
                              ids[b:b + 1])[:, Lp:]
        g = torch.autograd.grad((t["advantages"][b:b + 1].double() * logp
                                 * t["response_mask"][b:b + 1]).sum(), list(model.parameters()))
        exact.append(float(sum((x ** 2).sum() for x in g)))
    assert recs["exact_total_power"] == pytest.approx(float(np.mean(exact)), rel=1e-9)
    assert recs["verl_proxy_scale"] == pytest.approx(
        recs["exact_total_power"] / recs["verl_total_power"], rel=1e-12)
    assert -1 <= recs["verl_proxy_spearman"] <= 1
    with pytest.raises(UsageError, match="sum_pi_squared"):
        del t["sum_pi_squared"]
        verl_proxy_records(data, model, step=0)


# ---- inside verl's update: varbench_loss around verl's own ppo_loss ------------------------


def _micro_batches(seed: int = 0, *, per: int = 8):
    """verl's own pipeline from a trainer's DataProto to the actor's micro-batches:
    ``to_tensordict``, ``left_right_2_no_padding``, the global token count and dp size the FSDP
    engine assigns, ``prepare_micro_batches`` (fixed micro-batch size)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.utils import prepare_micro_batches
    from verl.workers.utils.padding import left_right_2_no_padding

    data = _actor_batch(seed)
    t = data.batch
    B = t["attention_mask"].shape[0]
    t["position_ids"] = (t["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    t["input_ids"] = torch.cat([t["prompts"], t["responses"]], 1)
    gen = torch.Generator().manual_seed(seed + 7)
    t["old_log_probs"] = -1.5 + 0.3 * torch.randn(t["response_mask"].shape, generator=gen,
                                                  dtype=torch.float64)
    t["advantages"] = t["advantages"].double()
    td = left_right_2_no_padding(data.to_tensordict())
    tu.assign_non_tensor(td, batch_num_tokens=int(td["loss_mask"].sum()), dp_size=1,
                         global_batch_size=B, use_dynamic_bsz=False,
                         micro_batch_size_per_gpu=per)
    return prepare_micro_batches(td)[0]


def _forward(model, mb, *, grad_rows=None):
    """log_probs as verl's FSDP engine returns them with remove-padding: one jagged nested
    tensor over the packed sequences, position i scoring token i + 1 (the packed ids rolled by
    one). ``grad_rows``: only those rows' log-probs carry a graph (the others run under
    no_grad: an independent per-row reference)."""
    ids = mb["input_ids"]
    vals = []
    for i, row in enumerate(ids.unbind()):
        with torch.set_grad_enabled(grad_rows is None or i in grad_rows):
            lp = torch.log_softmax(model(row[None]).logits[0].double(), -1)
            vals.append(lp.gather(-1, torch.roll(row, -1)[:, None])[:, 0])
    return {"log_probs": torch.nested.nested_tensor_from_jagged(torch.cat(vals), ids.offsets())}


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_varbench_loss_in_verls_ppo_loss_equals_per_row_gradients(mode):
    """varbench_loss around verl's ppo_loss on verl's micro-batches (float64): the loss and the
    training gradient are verl's unchanged, and varbench/grad_var_split equals ||sum_A g_i -
    sum_B g_i||^2 from per-row gradients of independent forwards (every other row under
    no_grad), halves = whole groups alternately by first appearance in the micro-batch."""
    from functools import partial

    from verl.utils.metric.utils import Metric
    from verl.workers.utils.losses import ppo_loss

    from varbench.integrations.verl import split_halves, varbench_loss
    from varbench.models import build_preset

    model = build_preset("micro", seed=0, dtype=torch.float64).model
    params = list(model.parameters())
    inner = partial(ppo_loss, config=_actor(loss_agg_mode=mode, clip_ratio=0.2))
    wrapped = varbench_loss(inner)
    collected: dict[str, list] = {}
    for mb in _micro_batches():
        plain, _ = inner(model_output=_forward(model, mb), data=mb, dp_group=None)
        want = torch.autograd.grad(plain, params)
        loss, metrics = wrapped(model_output=_forward(model, mb), data=mb, dp_group=None)
        assert float(loss.detach()) == float(plain.detach())
        got = torch.autograd.grad(loss, params)
        assert max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True)) == 0
        uid = [u for u in mb["uid"]]
        a, b = split_halves(uid)
        d = [torch.zeros_like(p) for p in params]
        for i in np.nonzero(a | b)[0]:
            gi = torch.autograd.grad(inner(model_output=_forward(model, mb, grad_rows={i}),
                                           data=mb, dp_group=None)[0], params)
            for acc, g in zip(d, gi, strict=True):
                acc.add_(g if a[i] else -g)
        ref = sum(float(x.pow(2).sum()) for x in d)
        assert ref > 0
        assert metrics["varbench/grad_var_split"].values == [pytest.approx(ref, rel=1e-10)]
        assert metrics["varbench/split_groups"].values == [2.0 * (len(set(uid)) // 2)]
        for k, v in metrics.items():
            collected.setdefault(k, []).append(v)
    # verl's own aggregation of the micro-batches' metrics (one data-parallel rank)
    per_micro = collected["varbench/grad_var_split"]
    rank = per_micro[0].init_list()
    for m in per_micro:
        rank.extend(m)
    assert Metric.aggregate_dp([rank]) == pytest.approx(np.mean([m.values[0] for m in per_micro]))


def test_varbench_loss_cadence_missing_uid_and_bad_options():
    from functools import partial

    from verl.workers.utils.losses import ppo_loss

    from varbench.integrations.verl import varbench_loss
    from varbench.models import build_preset

    model = build_preset("micro", seed=0, dtype=torch.float64).model
    inner = partial(ppo_loss, config=_actor(loss_agg_mode="token-mean"))
    every2 = varbench_loss(inner, every=2)
    mbs = _micro_batches(1, per=4)
    seen = [("varbench/grad_var_split" in every2(model_output=_forward(model, mb), data=mb)[1])
            for mb in mbs]
    assert seen == [True, False, True, False]
    # positional as the signature reads; verl's logits-processor call (no model_output) passes
    _, m = varbench_loss(inner)(_forward(model, mbs[0]), mbs[0], None)
    assert "varbench/grad_var_split" in m
    assert varbench_loss(lambda **kw: sorted(kw))(student_logits=1, data=2) == [
        "data", "student_logits"]
    with torch.no_grad():  # a forward-only call (compute_log_prob) measures nothing
        _, m = varbench_loss(inner)(model_output=_forward(model, mbs[0]), data=mbs[0])
    assert not any(k.startswith("varbench/") for k in m)
    mb = mbs[0]
    del mb["uid"]
    fn = varbench_loss(inner)
    with pytest.warns(UserWarning, match="no 'uid'"):
        _, m = fn(model_output=_forward(model, mb), data=mb)
    assert not any(k.startswith("varbench/") for k in m)
    for bad in (0, 1.5, True):
        with pytest.raises(UsageError, match="every="):
            varbench_loss(inner, every=bad)


def test_varbench_training_worker_wraps_the_loss_verl_installs():
    """The worker class for ActorRolloutRefWorker.actor_worker_cls: verl's TrainingWorker
    whose set_loss_fn (still registered for verl's dispatch) stores the wrapped loss."""
    from verl.single_controller.base.decorator import MAGIC_ATTR
    from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

    from varbench.integrations.verl import varbench_training_worker

    cls = varbench_training_worker(every=3)
    assert issubclass(cls, TrainingWorker)
    assert hasattr(cls.set_loss_fn, MAGIC_ATTR)

    class Worker(ActorRolloutRefWorker):
        actor_worker_cls = cls

    w = object.__new__(Worker.actor_worker_cls)  # TrainingWorker.__init__ needs a GPU engine
    w.set_loss_fn(lambda model_output, data, dp_group=None: (torch.tensor(0.0), {}))
    assert w.loss_fn.__name__ == "wrapped" and w.loss_fn.__qualname__.startswith("varbench_loss")


_FSDP2_RANKS = r"""
import pickle, sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from test_peers_verl import _actor, _forward, _micro_batches
from verl.workers.utils.losses import ppo_loss

from varbench.integrations.verl import varbench_loss
from varbench.models import build_preset

dist.init_process_group("gloo")
rank = dist.get_rank()
out = Path(sys.argv[1])
mb = _micro_batches()[rank]  # each rank its own micro-batch of the global batch
inner = partial(ppo_loss, config=_actor(loss_agg_mode="token-mean"))
# unsharded: this rank's own ||d_r||^2
plain = build_preset("micro", seed=0, dtype=torch.float64).model
_, m = varbench_loss(inner)(model_output=_forward(plain, mb), data=mb)
local = m["varbench/grad_var_split"].values[0]


def sharded(wrap):
    model = build_preset("micro", seed=0, dtype=torch.float64).model
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    fn = varbench_loss(inner) if wrap else inner
    loss, metrics = fn(model_output=_forward(model, mb), data=mb, dp_group=dist.group.WORLD)
    loss.backward()
    return metrics, [p.grad.to_local().clone() for p in model.parameters()]


metrics, grads = sharded(True)
_, want = sharded(False)
from torch.distributed.fsdp import FullyShardedDataParallel

from varbench._util.checks import UsageError

fsdp1 = FullyShardedDataParallel(build_preset("micro", seed=0, dtype=torch.float64).model,
                                 device_id=torch.device("cpu"), use_orig_params=True)
try:
    varbench_loss(inner)(model_output=_forward(fsdp1, mb), data=mb, dp_group=dist.group.WORLD)
    refused = ""
except UsageError as e:
    refused = str(e)
diff = max(float((a - b).abs().max()) for a, b in zip(grads, want, strict=True))
(out / f"rank{rank}.pkl").write_bytes(pickle.dumps(
    {"local": local, "value": metrics["varbench/grad_var_split"].values[0],
     "groups": metrics["varbench/split_groups"].values[0], "grad_diff": diff,
     "refused": refused}))
dist.barrier()  # no rank tears gloo down while the other is still in a collective
dist.destroy_process_group()
"""


def test_varbench_loss_under_fsdp2_on_two_ranks(tmp_path):
    """torchrun, 2 gloo ranks, the micro Llama under FSDP2 (fully_shard per decoder layer and
    the root), each rank one micro-batch: the extra backward runs on the unsharded parameters
    the forward used and leaves FSDP's sharded training gradients bit-identical; every rank
    records (||d_0||^2 + ||d_1||^2) / 4 with ||d_r||^2 the rank's own unsharded value. FSDP1
    (whose hooks reshard on a second backward: measured to crash verl's own backward) is
    refused with a message naming it."""
    import pickle
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "fsdp2_ranks.py"
    script.write_text(_FSDP2_RANKS)
    tests = str(Path(__file__).resolve().parent)
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{Path(tests).parent}:{tests}"}
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node", "2", str(script), str(tmp_path)],
                         env=env, text=True, capture_output=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    ranks = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in (0, 1)]
    assert all(r["grad_diff"] == 0 for r in ranks)
    want = (ranks[0]["local"] + ranks[1]["local"]) / 4
    assert want > 0 and ranks[0]["local"] != ranks[1]["local"]
    for r in ranks:
        assert r["value"] == pytest.approx(want, rel=1e-10)
        assert r["groups"] == 4
        assert "FSDP1" in r["refused"] and "fsdp2" in r["refused"]
