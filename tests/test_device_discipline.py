"""Device discipline of the analyses and the exact gradient harness, checked without a GPU.

(a) Each computation runs with the model on the CPU inside ``strict_device()`` (``meta`` as the
default device: a tensor made without the model's device lands on ``meta`` and any mix raises)
and gives the same result as outside it. (b) Under ``HostSyncs``, the same call on more tokens
(more responses or positions, same chunking) makes no more host syncs at any site of the hot
loops: a constant number per call is allowed (e.g. the one move of a record table to the host).

The models are 2-layer Llama / Qwen2 (transformers' Llama and Qwen2 run forward and backward
under the meta default device). The analyses sample through varbench.rollout inside the same
context (the sampler's own syncs are tested in test_device_discipline_train.py).
"""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from _devicecheck import HostSyncs, growing_sites, strict_device
from _fixtures_arch import build
from _fixtures_grads import batch as grad_batch

from varbench.grads import token_grad_norms
from varbench.grads.exact import iter_token_grads, token_chunks
from varbench.grads.group import group_gradients
from varbench.grads.sketch import sketched_token_norms
from varbench.grads.vectors import CountSketch, token_vectors
from varbench.models import build_preset
from varbench.rollout.sampler import sample
from varbench.tasks import get_task

pytestmark = pytest.mark.usefixtures("one_thread")

HOT = ("analysis/", "grads/", "estimators/")


def _same(a, b) -> None:
    """Equal results: tensors bitwise, frames exactly, containers element by element."""
    if isinstance(a, torch.Tensor):
        assert a.device == b.device and torch.equal(a, b)
    elif isinstance(a, pd.DataFrame):
        pd.testing.assert_frame_equal(a, b, check_exact=True)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    else:
        assert a == b or (a != a and b != b)


def _strict_equal(fn):
    """``fn()`` outside and inside ``strict_device()``: the same result (returned)."""
    ref = fn()
    with strict_device():
        got = fn()
    _same(ref, got)
    return ref


def _no_growth(small, large, prefixes=HOT) -> None:
    """Host syncs of ``small()`` and ``large()`` (more tokens): no site grows."""
    hs, hl = HostSyncs(), HostSyncs()
    with hs:
        small()
    with hl:
        large()
    grown = {k: v for p in prefixes for k, v in growing_sites(hs, hl, prefix=p).items()}
    assert not grown, grown
    return hs, hl


def _norms(n):
    return [n.token_sq, n.prefix_sq, n.diag_prefix_sq, n.sequence_sq, n.group_token_sq]


# ---------------------------------------------------------------- the exact harness


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_exact_harness_runs_under_the_meta_default_device(arch):
    model = build(arch)
    ids, rm, am = grad_batch(B=3, L=10)
    for method in ("ghost", "materialize"):
        _strict_equal(lambda m=method: _norms(token_grad_norms(model, ids, rm, am, groups=True,
                                                               method=m, chunk_size=3)))
    plist = list(model.parameters())
    for pack in (False, True):
        _strict_equal(lambda p=pack: [(r, c, g) for r, c, g in iter_token_grads(
            model, ids, rm, am, plist, 4, pack=p)])


def test_token_vectors_and_sketches_run_under_the_meta_default_device():
    from _fixtures_grads import rollout_batch

    model = build("llama")
    b = rollout_batch()
    numels = [p.numel() for p in model.parameters()]
    streamed = CountSketch(numels, 16, 3, stream=True, chunk=500)
    for kw in ({"sketch_dim": 16, "sketch_seed": 1}, {"sketch_dim": None},
               {"sketch": streamed}, {"sketch_dim": 16, "pack": True}):
        _strict_equal(lambda kw=kw: (lambda tv: [tv.vec, tv.token_sq])(
            token_vectors(model, b, **kw)))
    # the sketch's state generated on its device from the seed (same draws as outside)
    _strict_equal(lambda: CountSketch.for_model(model, 8, 5).hashes())
    _strict_equal(lambda: streamed.hashes())
    # the Gaussian (JVP) probes are drawn on their device too
    f = b.flat()
    _strict_equal(lambda: sketched_token_norms(model, f.input_ids, f.response_mask,
                                               f.attention_mask, k=3, seed=2).probes)
    c = torch.randn(b.P, b.G, b.T, generator=torch.Generator().manual_seed(0))
    sk = CountSketch.for_model(model, 8, 1)
    _strict_equal(lambda: group_gradients(model, b, c, sketch=sk))


def test_strict_device_catches_a_tensor_made_without_the_models_device():
    """The check itself: a tensor made without ``device=`` mixed with the model's raises."""
    model = build("llama")
    w = next(model.parameters())
    with strict_device(), pytest.raises((RuntimeError, NotImplementedError)):
        _ = w + torch.zeros(w.shape)  # the bug the meta default device exposes
    with strict_device(), pytest.raises((RuntimeError, NotImplementedError)):
        torch.arange(3).tolist()  # and a value read from such a tensor
    with strict_device():
        _ = w + torch.zeros(w.shape, device=w.device)  # the discipline: no error


def test_exact_harness_host_syncs_do_not_grow_with_tokens():
    model = build("llama")
    small, large = grad_batch(B=2, L=8), grad_batch(B=5, L=12)
    for method in ("ghost", "materialize"):
        _no_growth(lambda m=method: token_grad_norms(model, *small, method=m, chunk_size=3),
                   lambda m=method: token_grad_norms(model, *large, method=m, chunk_size=3))
    for method in ("ghost", "materialize"):  # several sequences per forward
        _no_growth(lambda m=method: token_grad_norms(model, *small, method=m, chunk_size=3,
                                                     pack=True),
                   lambda m=method: token_grad_norms(model, *large, method=m, chunk_size=3,
                                                     pack=True))
    plist = list(model.parameters())
    for pack in (False, True):
        _no_growth(lambda p=pack: list(iter_token_grads(model, *small, plist, 3, pack=p)),
                   lambda p=pack: list(iter_token_grads(model, *large, plist, 3, pack=p)))


def test_token_vectors_host_syncs_do_not_grow_with_tokens():
    from _fixtures_grads import rollout_batch

    model = build("qwen2")
    small, large = rollout_batch(P=2, G=3, T=6), rollout_batch(P=2, G=6, T=10)
    streamed = CountSketch([p.numel() for p in model.parameters()], 8, 0, stream=True,
                           chunk=700)
    for kw in ({"sketch_dim": 8}, {"sketch_dim": None}, {"sketch": streamed}):
        _no_growth(lambda kw=kw: token_vectors(model, small, **kw),
                   lambda kw=kw: token_vectors(model, large, **kw))


def test_token_chunks_plan_one_sequence_or_packed():
    rm = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [0, 0, 0, 0, 0], [0, 1, 0, 0, 0]])
    # one sequence per forward: chunks end at row ends; (start, stop, row_lo, row_hi, end)
    assert token_chunks(rm, 2) == [(0, 2, 0, 0, 3), (2, 3, 0, 0, 4), (3, 5, 1, 1, 4),
                                   (5, 6, 1, 1, 5), (6, 7, 3, 3, 2)]
    # packed: the next chunk_size tokens whatever their rows
    assert token_chunks(rm, 4, pack=True) == [(0, 4, 0, 1, 4), (4, 7, 1, 3, 5)]


# ---------------------------------------------------------------- the analyses


@pytest.fixture(scope="module")
def policy():
    return build_preset("micro", seed=0)


def test_proxy_records_run_under_the_meta_default_device(policy):
    from varbench.analysis.proxy import otb_baseline_records, proxy_correlation, token_records

    task = get_task("sort", n=2, max_value=3)
    res = _strict_equal(lambda: proxy_correlation({"a": policy}, task, n_prompts=2, G=3,
                                                  n_boot=10, reward="positional").records)
    assert len(res["tokens"]) == 2 * 3 * 2

    def records(P, G):
        b = sample(policy, task, task.prompts(P, seed=0), G, seed=0)
        return lambda: otb_baseline_records(b, token_records(policy, b, state="s"), state="s")
    _no_growth(records(1, 2), records(3, 4))


def test_variance_runs_under_the_meta_default_device(policy):
    from varbench.analysis.variance import estimator_variance

    task = get_task("sort", n=1, max_value=3)
    kw = dict(schemes=["centered", "otb", "otb_exact"], Gs=[2], n_prompts=1, n_boot=20,
              modes=["seq-mean-token-sum", "token-mean"], min_responses=0)  # M as given
    # the exact oracle (enumerated table: exact cells and table draws)
    res = _strict_equal(lambda: estimator_variance(policy, task, M=3, **kw).records)
    assert set(res["cells"]["method"]) == {"exact-sketched", "mc"}  # K = 1024 < D: sketched
    # a sampled reference and sketched vectors (Monte Carlo cells, sketch widening)
    skw = dict(kw, reference="sampled", n_ref=6, sketch_dim=16, exact="never")
    _strict_equal(lambda: estimator_variance(policy, task, M=3, **skw).records)
    # more groups (responses), same everything else: no site syncs per group or per token
    for k in (kw, skw):
        _no_growth(lambda k=k: estimator_variance(policy, task, M=3, **k),
                   lambda k=k: estimator_variance(policy, task, M=6, **k))


def test_cancellation_runs_under_the_meta_default_device(policy):
    from varbench.analysis.cancellation import cancellation

    kw = dict(inner_steps=[0, 1], sketch_dim=16, modes=["seq-mean-token-sum"],
              ratios=["token"])
    tasks = [get_task("arith")]
    _strict_equal(lambda: cancellation(policy, tasks, n_prompts=2, G=3, **kw).records)
    _no_growth(lambda: cancellation(policy, tasks, n_prompts=1, G=2, **kw),
               lambda: cancellation(policy, tasks, n_prompts=3, G=4, **kw))
