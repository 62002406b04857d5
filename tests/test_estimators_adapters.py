"""varbench.estimators.adapters: as_scheme (three shapes, one signature), from_flat, to_flat.

Equality claims are exact (``torch.equal``) on float64: every shape computes the same formula
with the same float operations (tests/_fixtures_estimators.py), only the layout differs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _fixtures_estimators import SHAPE_VARIANTS, random_case, shapes_scheme, shapes_verl

import varbench.estimators as E
from varbench._util.checks import UsageError, UsageTypeError
from varbench.estimators.registry import run_scheme

# ---- shape detection -----------------------------------------------------------------------


def _kw_only(rewards, mask, *, k=1):
    return rewards


def _annotated(rewards, mask, opts: E.SchemeOptions = None):
    return rewards


def _opts_default(rewards, mask, opts=None):
    return rewards


def _verl_renamed(scores, valid, index, epsilon=1e-6):
    return scores, scores


@pytest.mark.parametrize(
    ("fn", "shape"),
    [
        (shapes_scheme, "scheme"),
        (lambda a, b, c: a, "scheme"),  # an unnamed third positional parameter: opts
        (_annotated, "scheme"),
        (_opts_default, "scheme"),
        (SHAPE_VARIANTS["keywords"], "keywords"),
        (SHAPE_VARIANTS["kwargs"], "keywords"),
        (_kw_only, "keywords"),
        (lambda r, m: r, "keywords"),
        (lambda r, m, k=1: r, "keywords"),  # a third positional with a default is an option
        (shapes_verl, "verl"),
        (SHAPE_VARIANTS["verl_keyword_only"], "verl"),
        (_verl_renamed, "verl"),  # third positional named index
    ],
)
def test_scheme_shape_detection(fn, shape):
    assert E.scheme_shape(fn) == shape


@pytest.mark.parametrize(
    ("fn", "match"),
    [
        (lambda r: r, "wrong signature"),
        (lambda *a, **k: a, "wrong signature"),
        (3, "not callable"),
    ],
)
def test_scheme_shape_rejects_what_fits_no_shape(fn, match):
    with pytest.raises(UsageTypeError, match=match):
        E.scheme_shape(fn)
    with pytest.raises(UsageTypeError, match=match):
        E.register_scheme("test_never")(fn)
    assert "test_never" not in E.schemes()


def test_as_scheme_passes_the_scheme_shape_through_and_can_force_a_shape():
    assert E.as_scheme(shapes_scheme) is shapes_scheme
    wrapped = E.as_scheme(SHAPE_VARIANTS["keywords"])
    assert wrapped.shape == "keywords" and wrapped.source is SHAPE_VARIANTS["keywords"]
    assert E.as_scheme(wrapped) is wrapped  # adapting twice changes nothing
    assert E.scheme_shape(wrapped) == "scheme"

    def unnamed_verl(a, b, c):
        adv = a.sum(-1, keepdim=True) * b
        return adv, adv

    forced = E.as_scheme(unnamed_verl, shape="verl")
    rewards, mask, _ = random_case(2, 3, 4, 0)
    got = run_scheme(forced, rewards, mask)
    torch.testing.assert_close(got, E.advantages("raw", rewards, mask), rtol=0, atol=0)
    with pytest.raises(UsageError, match="shape='flat' is not valid.*'keywords'"):
        E.as_scheme(unnamed_verl, shape="flat")


# ---- every shape gives the canonical advantages --------------------------------------------


def _cases():
    """(rewards, mask, options) covering outcome/token rewards, multi-turn masks, G = 1,
    a SchemeOptions scalar (eps), an extra option (scale) and the token statistics."""
    out = []
    for seed, (P, G, T) in enumerate([(3, 4, 5), (2, 1, 3), (4, 6, 7)]):
        for token_rewards in (False, True):
            rewards, mask, o = random_case(P, G, T, seed, token_rewards=token_rewards,
                                           multi_turn=True, allow_empty=True)
            if token_rewards:  # as rollouts give them (verl-shaped estimators sum whole rows)
                rewards = torch.where(mask, rewards, 0)
            out.append((rewards, mask, {}))
            out.append((rewards, mask, {"eps": 0.25, "scale": -1.5}))
            out.append((rewards, mask, {"logprobs": o["logprobs"], "sum_pi_sq": o["sum_pi_sq"],
                                        "importance_weights": o["importance_weights"],
                                        "scale": 2.0}))
    return out


CASES = _cases()


@pytest.mark.parametrize("variant", list(SHAPE_VARIANTS))
def test_every_shape_registers_and_matches_the_canonical_float64(variant):
    fn = SHAPE_VARIANTS[variant]
    name = f"test_shape_{variant}"
    assert E.register_scheme(name, extra_options=("scale",))(fn) is fn  # returned unchanged
    try:
        scheme, extra, _ = E.scheme_info(name)
        assert extra == ("scale",) and E.scheme_shape(scheme) == "scheme"
        for rewards, mask, opts in CASES:
            want = run_scheme(shapes_scheme, rewards, mask, opts, extra_options=("scale",))
            got = E.advantages(name, rewards, mask, **opts)
            assert got.dtype == torch.float64
            assert torch.equal(got, want), (variant, opts.keys())
        E.register_scheme(name, extra_options=("scale",))(fn)  # the same function again: fine
    finally:
        E.unregister_scheme(name)


@pytest.mark.parametrize("variant", ["keywords", "kwargs", "verl"])
def test_token_statistics_reach_the_function_under_its_names(variant):
    seen = {}

    def spy_keywords(rewards, mask, *, logprobs=None, importance_weights=None):
        seen.update(logprobs=logprobs, importance_weights=importance_weights)
        return torch.zeros(mask.shape, dtype=rewards.dtype)

    def spy_kwargs(rewards, mask, **options):
        seen.update(options)
        return torch.zeros(mask.shape, dtype=rewards.dtype)

    def spy_verl(token_level_rewards, response_mask, index, old_log_probs=None,
                 rollout_is_weights=None):
        seen.update(logprobs=old_log_probs, importance_weights=rollout_is_weights, index=index)
        return torch.zeros_like(token_level_rewards), None

    fn = {"keywords": spy_keywords, "kwargs": spy_kwargs, "verl": spy_verl}[variant]
    rewards, mask, o = random_case(2, 3, 4, 0)
    opts = {"logprobs": o["logprobs"], "importance_weights": o["importance_weights"],
            "sum_pi_sq": o["sum_pi_sq"]}  # sum_pi_sq: dropped where not accepted
    run_scheme(E.as_scheme(fn), rewards, mask, opts)
    flat = variant == "verl"
    for key in ("logprobs", "importance_weights"):
        want = opts[key].reshape(6, 4) if flat else opts[key]
        assert torch.equal(seen[key], want)
    if variant == "kwargs":  # a catch-all receives what was given, nothing else
        assert set(seen) == {"logprobs", "importance_weights", "sum_pi_sq"}
    if flat:
        assert seen["index"].tolist() == [0, 0, 0, 1, 1, 1]


# ---- options a function cannot take --------------------------------------------------------


def _plain(rewards, mask):
    return torch.where(mask, rewards.unsqueeze(-1), 0)


def test_a_set_option_the_function_cannot_take_raises_naming_it():
    rewards, mask, o = random_case(2, 3, 4, 0)
    E.register_scheme("test_plain")(_plain)
    try:
        with pytest.raises(UsageTypeError, match=r"option k=2 cannot be passed to _plain.*"
                                                 r"takes no keyword 'k'"):
            E.advantages("test_plain", rewards, mask, k=2)
        with pytest.raises(TypeError, match="eps=0.5"):
            E.advantages("test_plain", rewards, mask, eps=0.5)
        # A caller passing an option at its default, or token statistics, to every scheme
        # (the trainer, the variance analysis) is not refused: both are dropped.
        want = E.advantages("raw", rewards, mask)
        got = E.advantages("test_plain", rewards, mask, k=1, logprobs=o["logprobs"],
                           sum_pi_sq=o["sum_pi_sq"])
        assert torch.equal(got, want)
    finally:
        E.unregister_scheme("test_plain")


def test_verl_function_refuses_options_it_cannot_take():
    def grpo_like(token_level_rewards, response_mask, index, epsilon=1e-6):
        return token_level_rewards, token_level_rewards

    rewards, mask, _ = random_case(2, 3, 4, 0)
    scheme = E.as_scheme(grpo_like, extra_options=("epsilon",))
    run_scheme(scheme, rewards, mask, {"epsilon": 1e-3}, extra_options=("epsilon",))
    with pytest.raises(UsageTypeError, match=r"unbiased_std=False.*grpo_like.*\['epsilon'\]"):
        run_scheme(scheme, rewards, mask, {"unbiased_std": False})


def test_registration_refuses_extras_and_required_keywords_it_cannot_supply():
    with pytest.raises(UsageTypeError, match="declared extra option.*'temperature'"):
        E.register_scheme("test_never", extra_options=("temperature",))(_plain)

    def needs_temperature(rewards, mask, *, temperature):
        return rewards

    with pytest.raises(UsageTypeError, match=r"requires keyword argument\(s\) \['temperature'\]"):
        E.register_scheme("test_never")(needs_temperature)
    E.register_scheme("test_temp", extra_options=("temperature",))(needs_temperature)
    try:
        with pytest.raises(UsageError, match=r"requires option\(s\) \['temperature'\]"):
            E.advantages("test_temp", torch.zeros(1, 2), torch.ones(1, 2, 3))
    finally:
        E.unregister_scheme("test_temp")
    assert "test_never" not in E.schemes()


def test_a_required_token_statistic_that_is_missing_is_named():
    def needs_logprobs(rewards, mask, *, logprobs):
        return logprobs

    rewards, mask, o = random_case(2, 3, 4, 0)
    scheme = E.as_scheme(needs_logprobs)
    assert torch.equal(run_scheme(scheme, rewards, mask, {"logprobs": o["logprobs"]}),
                       torch.where(mask, o["logprobs"], 0))
    with pytest.raises(UsageError, match=r"requires option\(s\) \['logprobs'\]"):
        run_scheme(scheme, rewards, mask)


def test_given_options_override_the_function_default_and_others_keep_it():
    def topk2(rewards, mask, *, k=2):
        return torch.full(mask.shape, float(k), dtype=torch.float64)

    rewards, mask, _ = random_case(1, 2, 3, 0)
    scheme = E.as_scheme(topk2)
    assert run_scheme(scheme, rewards, mask)[mask].unique().tolist() == [2.0]
    assert run_scheme(scheme, rewards, mask, {"k": 1})[mask].unique().tolist() == [1.0]
    assert run_scheme(scheme, rewards, mask, {"k": 3})[mask].unique().tolist() == [3.0]
    assert E.SchemeOptions(k=3, eps=1e-6).given == {"k"}  # built directly: the non-defaults


def test_verl_output_is_checked():
    rewards, mask, _ = random_case(2, 3, 4, 0)
    bad_shape = E.as_scheme(lambda token_level_rewards, response_mask, index: (
        token_level_rewards[:, :2], None))
    with pytest.raises(UsageError, match=r"shape \[6, 2\], expected \[B, T\] = \[6, 4\]"):
        run_scheme(bad_shape, rewards, mask)
    not_tensor = E.as_scheme(lambda token_level_rewards, response_mask, index: ([1.0], None))
    with pytest.raises(UsageTypeError, match="returned list"):
        run_scheme(not_tensor, rewards, mask)


# ---- verl's flat layout: from_flat, to_flat (unequal groups) -------------------------------


def verl_style_grpo(token_level_rewards, response_mask, index, epsilon=1e-6):
    """A verl-shaped GRPO written group by group (as verl's compute_grpo_outcome_advantage)."""
    scores = token_level_rewards.sum(-1)
    out = torch.zeros_like(scores)
    for g in np.unique(index):
        rows = np.nonzero(index == g)[0]
        s = scores[rows]
        out[rows] = (s - s.mean()) / (s.std() + epsilon) if len(rows) > 1 else s
    adv = out.unsqueeze(-1) * response_mask
    return adv, adv


def test_from_flat_registers_verl_function():
    name = E.from_flat(verl_style_grpo, "test_verl_grpo", extra_options=("epsilon",))
    try:
        rewards, mask, _ = random_case(3, 4, 5, 0, multi_turn=True)
        got = E.advantages(name, rewards, mask, epsilon=1e-6)
        torch.testing.assert_close(got, E.advantages("normalized", rewards, mask))
    finally:
        E.unregister_scheme(name)
    E.register_scheme("test_verl_grpo", extra_options=("epsilon",))(verl_style_grpo)  # directly
    try:
        torch.testing.assert_close(E.advantages("test_verl_grpo", rewards, mask),
                                   E.advantages("normalized", rewards, mask))
    finally:
        E.unregister_scheme("test_verl_grpo")


@pytest.mark.parametrize("scheme", ["centered", "otb", "rloo"])
def test_to_flat_round_trip(scheme):
    rewards, mask, opts = random_case(3, 4, 5, 1, multi_turn=True)
    kw = {"token_weights": opts["token_weights"]} if scheme == "otb" else {}
    # varbench's own conventions: with "verl" (to_flat's default) otb on these multi-turn
    # masks is verl's optimal_token_baseline by design (tests/test_peers_verl.py)
    flat = E.to_flat(scheme, conventions="varbench")
    name = E.from_flat(flat, f"test_rt_{scheme}", pass_options={"token_weights": "token_weights"})
    try:
        torch.testing.assert_close(
            E.advantages(name, rewards, mask, **kw), E.advantages(scheme, rewards, mask, **kw)
        )
    finally:
        E.unregister_scheme(name)
    E.register_scheme(f"test_rt2_{scheme}")(flat)  # registered directly: detected as verl
    try:
        torch.testing.assert_close(E.advantages(f"test_rt2_{scheme}", rewards, mask, **kw),
                                   E.advantages(scheme, rewards, mask, **kw))
    finally:
        E.unregister_scheme(f"test_rt2_{scheme}")


def test_to_flat_takes_verl_names_for_the_token_statistics():
    rewards, mask, o = random_case(3, 4, 5, 2)
    B, T = 12, 5
    tok = E.outcome_to_token_rewards(rewards, mask).reshape(B, T)
    m = mask.double().reshape(B, T)
    ids = np.repeat(np.arange(3), 4)
    adv, _ = E.to_flat("otb")(tok, m, ids, old_log_probs=o["logprobs"].reshape(B, T),
                              sum_pi_squared=o["sum_pi_sq"].reshape(B, T))
    want = E.advantages("otb", rewards, mask, logprobs=o["logprobs"], sum_pi_sq=o["sum_pi_sq"])
    torch.testing.assert_close(adv, want.reshape(B, T), rtol=1e-12, atol=1e-12)
    with pytest.raises(UsageError, match="'logprobs' given twice"):
        E.to_flat("otb")(tok, m, ids, logprobs=o["logprobs"].reshape(B, T),
                         old_log_probs=o["logprobs"].reshape(B, T))


def test_to_flat_shuffled_and_unequal_groups():
    # Rows of 3 groups (sizes 2, 3, 3) shuffled; string ids. Per group result = centered.
    gen = torch.Generator().manual_seed(0)
    ids = np.array(["a", "b", "c", "b", "a", "c", "b", "c"])
    R = torch.randn(8, generator=gen, dtype=torch.float64)
    mask = torch.ones(8, 3, dtype=torch.float64)
    tok = torch.zeros(8, 3, dtype=torch.float64)
    tok[:, -1] = R
    adv, ret = E.to_flat("centered")(tok, mask, ids)
    for g in "abc":
        rows = np.nonzero(ids == g)[0]
        want = (R[rows] - R[rows].mean()).unsqueeze(-1).expand(-1, 3)
        torch.testing.assert_close(adv[rows], want)
    assert ret is adv
    with pytest.raises(ValueError, match="index has shape"):
        E.to_flat("centered")(tok, mask, ids[:3])
    # verl's compute_advantage always passes config: accepted; an unknown option raises
    E.to_flat("centered")(tok, mask, ids, config=None)
    with pytest.raises(TypeError, match="unknown option 'reward_baselines'.*ignore="):
        E.to_flat("centered")(tok, mask, ids, reward_baselines=R)
    got, _ = E.to_flat("centered", ignore=("reward_baselines",))(tok, mask, ids,
                                                                 reward_baselines=R)
    assert torch.equal(got, adv)
    E.to_flat("centered", ignore_unknown=True)(tok, mask, ids, reward_baselines=R)


@pytest.mark.parametrize("variant", ["verl", "verl_keyword_only", "keywords"])
def test_registered_verl_function_with_unequal_groups_matches_itself(variant):
    """A verl-shaped function registered, then called through to_flat on shuffled groups of
    sizes 1, 2, 3 and 4, gives what the function gives on that flat batch directly."""
    gen = torch.Generator().manual_seed(3)
    sizes = {"a": 1, "b": 2, "c": 3, "d": 4}
    ids = np.array([g for g, n in sizes.items() for _ in range(n)])
    ids = ids[torch.randperm(len(ids), generator=gen).numpy()]
    B, T = len(ids), 6
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    mask = (torch.arange(T) < lengths.unsqueeze(-1)).double()
    tok = torch.randn(B, T, generator=gen, dtype=torch.float64) * mask
    lp = -torch.rand(B, T, generator=gen, dtype=torch.float64) * mask
    sp = torch.rand(B, T, generator=gen, dtype=torch.float64) * mask
    name = f"test_unequal_{variant}"
    E.register_scheme(name, extra_options=("scale",))(SHAPE_VARIANTS[variant])
    try:
        got, _ = E.to_flat(name)(tok, mask, ids, old_log_probs=lp, sum_pi_squared=sp, scale=0.5)
    finally:
        E.unregister_scheme(name)
    want, _ = shapes_verl(tok, mask, ids, old_log_probs=lp, sum_pi_squared=sp, scale=0.5)
    assert torch.equal(got, want)


# ---- verl drop-in: config, verl keywords, ignore, ragged batch-coupled schemes ---------------


def _ragged_batch(seed=5):
    gen = torch.Generator().manual_seed(seed)
    ids = np.array([0, 1, 1, 2, 2, 2, 3, 3, 3, 3])[torch.randperm(10, generator=gen).numpy()]
    B, T = len(ids), 4
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    mask = (torch.arange(T) < lengths[:, None]).double()
    R = torch.randn(B, generator=gen, dtype=torch.float64)
    tok = torch.zeros(B, T, dtype=torch.float64).scatter_(1, (lengths - 1)[:, None], R[:, None])
    return ids, R, mask, tok, lengths


@pytest.mark.parametrize("conventions", ["varbench", "verl", "trl"])
def test_to_flat_batch_coupled_schemes_over_unequal_groups_match_a_loop(conventions):
    ids, R, mask, tok, lengths = _ragged_batch()
    c = torch.zeros_like(R)
    for g in np.unique(ids):
        rows = np.nonzero(ids == g)[0]
        lone = len(rows) == 1
        c[rows] = R[rows] if lone and conventions == "verl" else R[rows] - R[rows].mean()
    L = lengths.double()
    n = L.sum()
    mu = (c * L).sum() / n
    var = (L * (c - mu) ** 2).sum() / (n - 1)
    if conventions == "verl":  # verl's masked_mean divides by n + 1e-8
        mu = (c * L).sum() / (n + 1e-8)
        var = (L * (c - mu) ** 2).sum() / (n + 1e-8) * n / (n - 1)
    want = ((c - mu) / torch.sqrt(var + 1e-8))[:, None] * mask
    got, _ = E.to_flat("reinforce_pp_baseline", conventions=conventions)(tok, mask, ids)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    want = (c / (R.std() + 1e-4))[:, None] * mask
    got, _ = E.to_flat("normalized_batch", conventions=conventions)(tok, mask, ids, eps=1e-4)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_to_flat_reads_verl_config_and_keywords_and_refuses_the_rest():
    ids, R, mask, tok, _ = _ragged_batch(6)
    fn = E.to_flat("normalized")
    centered, _ = E.to_flat("centered")(tok, mask, ids)
    for kw in ({"config": {"norm_adv_by_std_in_grpo": False}},
               {"norm_adv_by_std_in_grpo": False}):
        got, _ = fn(tok, mask, ids, **kw)
        torch.testing.assert_close(got, centered, rtol=0, atol=0)
    with pytest.raises(ValueError, match="contradicts config"):
        fn(tok, mask, ids, norm_adv_by_std_in_grpo=True,
           config={"norm_adv_by_std_in_grpo": False})
    a, _ = fn(tok, mask, ids, epsilon=0.5)
    b, _ = fn(tok, mask, ids, eps=0.5)
    assert torch.equal(a, b) and not torch.equal(a, fn(tok, mask, ids)[0])
    fn(tok, mask, ids, epsilon=1e-6)  # verl's default is accepted for any scheme
    with pytest.raises(TypeError, match="epsilon=0.5 has no meaning for scheme 'rloo'"):
        E.to_flat("rloo")(tok, mask, ids, epsilon=0.5)
    with pytest.raises(TypeError, match="unknown option 'gamma'"):
        E.to_flat("rloo")(tok, mask, ids, gamma=0.9)
    E.to_flat("rloo", ignore=("gamma",))(tok, mask, ids, gamma=0.9)
    # options given at construction are checked there, before any rollout
    with pytest.raises(TypeError, match="unknown option 'foo'"):
        E.to_flat("rloo", foo=1)
    with pytest.raises(TypeError, match="epsilon=0.5 has no meaning"):
        E.to_flat("rloo", epsilon=0.5)
    E.to_flat("rloo", foo=1, ignore=("foo",))
    with pytest.raises(ValueError, match="index=None"):
        E.to_flat("rloo")(tok, mask, None)


def test_to_flat_otb_returns_reward_to_go_and_empty_groups_get_zero():
    ids, R, mask, tok, _ = _ragged_batch(7)
    w = torch.rand(mask.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    adv, ret = E.to_flat("otb")(tok, mask, ids, token_weights=w)
    torch.testing.assert_close(ret, (tok * mask).flip(-1).cumsum(-1).flip(-1))
    assert adv is not ret
    mask[ids == 0] = 0  # the lone response of group 0 is empty: no call, advantages 0
    adv, _ = E.to_flat("rloo")(tok, mask, ids)
    assert torch.all(adv[ids == 0] == 0)


@pytest.mark.parametrize("scheme, varbench, verl, trl", [
    ("normalized", "R", "R/(1+eps)", "0"), ("rloo", "R", "R", "0"),
    ("centered", "0", "R", "0"), ("opo", "0", "R", "0"),
])
def test_conventions_for_groups_of_one(scheme, varbench, verl, trl):
    R = torch.tensor([[0.7], [-1.5]], dtype=torch.float64)
    mask = torch.ones(2, 1, 3, dtype=torch.bool)
    scale = float(torch.tensor(1.0) + 1e-6)  # verl's float32 std of 1 plus epsilon
    values = {"R": R, "0": torch.zeros_like(R), "R/(1+eps)": R / scale}
    for conv, want in (("varbench", varbench), ("verl", verl), ("trl", trl)):
        got = E.advantages(scheme, R, mask, conventions=conv)
        torch.testing.assert_close(got, values[want].unsqueeze(-1).expand(2, 1, 3),
                                   rtol=0, atol=0)
    with pytest.raises(ValueError, match="conventions='tf'"):
        E.advantages(scheme, R, mask, conventions="tf")
