"""varbench.rollout.sampler: recorded statistics equal a teacher-forced forward, seeds,
stops, the environment loop, filters and errors."""

from __future__ import annotations

import pytest
import torch
from reference_rollout import reference_sample, teacher_forced
from transformers import GPT2Config, GPT2LMHeadModel

from varbench.models import Policy, build_preset, build_tokenizer
from varbench.rollout import RolloutBatch, sample
from varbench.tasks import Prompt, get_task
from varbench.tasks.sort import SortTask

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def micro():
    return build_preset("micro", seed=0)


def check_batch_invariants(batch: RolloutBatch, task):
    P, G, T = batch.tokens.shape
    assert batch.rewards.shape == (P, G) and batch.lengths.shape == (P, G)
    assert ((batch.mask * batch.env_mask) == 0).all()
    assert torch.equal(batch.lengths, batch.mask.sum(-1).long())
    for x in (batch.logprobs, batch.sum_pi_sq, batch.entropy):
        assert (x[batch.mask == 0] == 0).all()
    # every response is a contiguous run of real tokens followed by padding only
    real = batch.mask + batch.env_mask
    assert (real[..., 1:] <= real[..., :-1]).all()
    assert (batch.mask[..., 0] == 1).all()
    assert len(batch.texts) == P and all(len(r) == G for r in batch.texts)
    prompts = batch.meta["prompt_objects"]
    for p in range(P):
        for i in range(G):
            assert batch.rewards[p, i] == task.score(prompts[p], batch.texts[p][i],
                                                     batch.meta["reward"])


@pytest.mark.parametrize("name,knobs", [("sort", {}), ("arith", {"digits": 2}), ("toolsum", {})])
def test_recorded_stats_equal_teacher_forcing(micro, name, knobs):
    task = get_task(name, **knobs)
    prompts = task.prompts(4, seed=1)
    batch = sample(micro, task, prompts, 8, seed=3)
    check_batch_invariants(batch, task)
    lp, sp, ent = teacher_forced(micro, batch)
    assert (lp - batch.logprobs).abs().max() < 1e-5
    assert (sp - batch.sum_pi_sq).abs().max() < 1e-5
    assert (ent - batch.entropy).abs().max() < 1e-5


def test_left_padding_eos_and_env_tokens_all_occur(micro):
    """The equality above is only meaningful if the batches exercise every padding path."""
    arith = get_task("arith", digits=2)
    prompts = arith.prompts(4, seed=1)
    lens = {len(p.text) for p in prompts}
    assert len(lens) > 1  # prompts of different lengths -> left padding
    b = sample(micro, arith, prompts, 8, seed=3)
    assert b.lengths.min() < b.lengths.max()  # some rows stopped at EOS
    eos = micro.tokenizer.eos_token_id
    for p in range(b.P):
        for i in range(b.G):
            n = int(b.lengths[p, i])
            if n < b.T:
                assert b.tokens[p, i, n - 1] == eos
    tool = get_task("toolsum")
    t = sample(micro, tool, tool.prompts(4, seed=1), 8, seed=3)
    assert t.env_mask.sum() > 0


def test_fixed_length_ignores_eos(micro):
    task = get_task("sort", n=4)
    b = sample(micro, task, task.prompts(8, seed=0), 16, seed=0)
    assert b.T == 4 and (b.lengths == 4).all()


def test_env_segments_are_the_environments_replies(micro):
    """Replay every toolsum transcript: each env segment is env_step of the text before it."""
    task = get_task("toolsum")
    prompts = task.prompts(4, seed=2)
    b = sample(micro, task, prompts, 8, seed=5)
    tok = micro.tokenizer
    n_checked = 0
    for p in range(b.P):
        for i in range(b.G):
            toks = b.tokens[p, i].tolist()
            env = b.env_mask[p, i].tolist()
            real = (b.mask[p, i] + b.env_mask[p, i]).tolist()
            t = 0
            while t < b.T:
                if env[t] != 1:
                    t += 1
                    continue
                e = t
                while e < b.T and env[e] == 1:
                    e += 1
                before = tok.decode([x for x, r in zip(toks[:t], real[:t], strict=False) if r > 0],
                                    skip_special_tokens=True)
                reply = task.env_step(prompts[p], before)
                want = tok(reply, add_special_tokens=False)["input_ids"]
                assert toks[t:e] == want[: e - t]
                assert before.endswith("</call>")
                n_checked += 1
                t = e
    assert n_checked > 0


def test_same_seed_same_batch_and_generator(micro):
    task = get_task("arith")
    prompts = task.prompts(3, seed=0)
    a = sample(micro, task, prompts, 4, seed=11)
    b = sample(micro, task, prompts, 4, seed=11)
    c = sample(micro, task, prompts, 4, seed=12)
    d = sample(micro, task, prompts, 4, generator=torch.Generator().manual_seed(11))
    for x, y in ((a, b), (a, d)):
        assert torch.equal(x.tokens, y.tokens) and torch.equal(x.logprobs, y.logprobs)
        assert x.texts == y.texts
    assert not torch.equal(a.tokens, c.tokens)


def test_kv_cache_sampler_matches_no_cache_reference_float64():
    policy = build_preset("micro", seed=4, dtype=torch.float64)
    task = get_task("sort", n=4)  # fixed length: no stopping logic in the reference
    prompts = task.prompts(3, seed=0)
    b = sample(policy, task, prompts, 5, seed=9)
    assert b.logprobs.dtype == torch.float64
    assert torch.equal(b.tokens, reference_sample(policy, task, prompts, 5, seed=9))
    lp, _, _ = teacher_forced(policy, b)
    assert (lp - b.logprobs).abs().max() < 1e-10


@pytest.mark.parametrize("tie,attn", [(True, "sdpa"), (False, "eager")])
def test_tied_and_eager_policies(tie, attn):
    policy = build_preset("micro", seed=1, tie_embeddings=tie, attn_implementation=attn)
    task = get_task("arith")
    b = sample(policy, task, task.prompts(3, seed=0), 4, seed=0)
    lp, _, _ = teacher_forced(policy, b)
    assert (lp - b.logprobs).abs().max() < 1e-5


def test_foreign_architecture_gpt2_same_code_path():
    tok = build_tokenizer()
    cfg = GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=16, n_layer=2, n_head=2,
                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(cfg).eval()
    policy = Policy(model=model, tokenizer=tok, name="gpt2-test")
    task = get_task("toolsum")
    b = sample(policy, task, task.prompts(2, seed=0), 4, seed=0)
    lp, _, _ = teacher_forced(policy, b)
    assert (lp - b.logprobs).abs().max() < 1e-5


def test_greedy_and_filters(micro):
    task = get_task("sort")
    prompts = task.prompts(2, seed=0)
    g1 = sample(micro, task, prompts, 3, greedy=True, seed=1)
    g2 = sample(micro, task, prompts, 3, greedy=True, seed=2)
    assert torch.equal(g1.tokens, g2.tokens)
    assert (g1.tokens == g1.tokens[:, :1]).all()  # every row of a group is the argmax path
    k1 = sample(micro, task, prompts, 3, top_k=1, seed=5)
    assert torch.equal(k1.tokens, g1.tokens)
    assert not g1.meta["on_policy"] and not k1.meta["on_policy"]
    assert sample(micro, task, prompts, 3, seed=5).meta["on_policy"]
    # recorded statistics are those of pi even under a modified sampler
    lp, _, _ = teacher_forced(micro, k1)
    assert (lp - k1.logprobs).abs().max() < 1e-5
    tp = sample(micro, task, prompts, 3, top_p=1e-6, temperature=0.5, seed=5)
    assert torch.equal(tp.tokens, g1.tokens)


def test_rewards_follow_the_reward_argument(micro):
    task = get_task("sort")
    prompts = task.prompts(2, seed=0)
    b = sample(micro, task, prompts, 6, seed=0, reward="inclusion_adjacency")
    assert b.meta["reward"] == "inclusion_adjacency"
    assert b.rewards.sum() > 0  # random digits already include prompt numbers


class _NoForward(torch.nn.Module):
    """Fails the test if the sampler runs the model before validating its input."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.config = inner.config

    def forward(self, *a, **k):
        raise AssertionError("model was called before the input was validated")


def test_bad_input_fails_before_any_work(micro):
    guarded = Policy(model=_NoForward(micro.model), tokenizer=micro.tokenizer, name="guarded")
    task = get_task("sort")
    prompts = task.prompts(2, seed=0)
    with pytest.raises(ValueError, match="G=0"):
        sample(guarded, task, prompts, 0)
    with pytest.raises(ValueError, match="prompts"):
        sample(guarded, task, [], 2)
    with pytest.raises(ValueError, match="context"):
        sample(guarded, task, prompts, 2, max_new_tokens=500)
    with pytest.raises(ValueError, match=r"reward='nope'.*positional"):
        sample(guarded, task, prompts, 2, reward="nope")
    with pytest.raises(ValueError, match="temperature"):
        sample(guarded, task, prompts, 2, temperature=0)
    with pytest.raises(ValueError, match="top_p"):
        sample(guarded, task, prompts, 2, top_p=1.5)

    class NeedsX(SortTask):
        @property
        def alphabet(self):
            return (*super().alphabet, "x")

    NeedsX.name = "needs_x"
    with pytest.raises(ValueError, match=r"exactly one token: \['x'\]"):
        sample(guarded, NeedsX(), prompts, 2)
    with pytest.raises(TypeError, match="Prompt"):
        sample(guarded, task, ["<sort>123="], 2)
    long_prompt = Prompt(text="<sort>" + "1" * 200 + "=", answer="1", meta={"data": (1,)})
    with pytest.raises(ValueError, match="exceeds the context"):
        sample(guarded, task, [long_prompt], 2)


def test_masked_vocabulary_gives_finite_entropy():
    """A checkpoint that masks tokens with -inf logits must not produce NaN statistics."""
    policy = build_preset("micro", seed=0)
    head = policy.model.lm_head

    class Masked(torch.nn.Module):
        def forward(self, h):
            z = head(h)
            return z.index_fill(-1, torch.tensor([3, 4]), float("-inf"))

    policy.model.lm_head = Masked()
    task = get_task("sort")
    b = sample(policy, task, task.prompts(2, seed=0), 4, seed=0)
    assert torch.isfinite(b.entropy).all() and torch.isfinite(b.logprobs).all()
    assert not ((b.tokens == 3) | (b.tokens == 4)).any()


def test_outputs_are_ordinary_tensors_usable_in_autograd(micro):
    task = get_task("sort")
    b = sample(micro, task, task.prompts(2, seed=0), 3, seed=0)
    assert not b.logprobs.is_inference() and not b.rewards.is_inference()
    w = torch.ones_like(b.logprobs, requires_grad=True)
    (w * b.logprobs * b.rewards[..., None]).sum().backward()  # saves b's tensors for backward
    assert torch.equal(w.grad, b.logprobs * b.rewards[..., None])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name,knobs,G", [("sort", {}, 3), ("arith", {"digits": 2}, 5)])
def test_deferred_statistics_equal_per_step_statistics(monkeypatch, dtype, name, knobs, G):
    """Statistics computed once over [B, T, V] after the loop equal the per-step ones bitwise."""
    from varbench.rollout import sampler

    policy = build_preset("micro", seed=2, dtype=dtype)
    task = get_task(name, **knobs)
    prompts = task.prompts(3, seed=4)  # B = 3 * G rows: odd sizes, rows stop at EOS (arith)
    fast = sample(policy, task, prompts, G, seed=1)
    monkeypatch.setattr(sampler, "_DEFER_MAX", 0)  # force the per-step path
    slow = sample(policy, task, prompts, G, seed=1)
    for f in ("tokens", "mask", "logprobs", "sum_pi_sq", "entropy", "lengths"):
        x, y = getattr(fast, f), getattr(slow, f)
        assert x.dtype == y.dtype and torch.equal(x, y), f
        assert torch.equal(torch.signbit(x.float()), torch.signbit(y.float())), f


# ---- differentiable=True: the log-probs carry the graph of the sampler's own model calls

def _float64_policy(model, name):
    from varbench.grads.precision import exact_float64

    return Policy(model=exact_float64(model), tokenizer=build_tokenizer(), name=name)


def _check_differentiable(policy, task, prompts, G, seed):
    """Same draws and values as plain sampling; the gradient of a weighted sum of the
    log-probs equals the teacher-forced forward's (float64: rtol 1e-9, atol 1e-12)."""
    from varbench.rollout import response_logprobs

    plain = sample(policy, task, prompts, G, seed=seed)
    diff = sample(policy, task, prompts, G, seed=seed, differentiable=True)
    for f in ("tokens", "mask", "env_mask", "rewards", "lengths"):
        assert torch.equal(getattr(diff, f), getattr(plain, f)), f
    assert diff.texts == plain.texts
    assert diff.logprobs.requires_grad and not plain.logprobs.requires_grad
    assert not diff.sum_pi_sq.requires_grad and not diff.entropy.requires_grad
    for f in ("logprobs", "sum_pi_sq", "entropy"):  # the same bits as plain sampling
        assert torch.equal(getattr(diff, f).detach(), getattr(plain, f)), f
    assert (diff.logprobs.detach()[diff.mask == 0] == 0).all()
    params = [p for p in policy.model.parameters() if p.requires_grad]
    w = torch.randn(plain.logprobs.shape, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(seed))
    got = torch.autograd.grad((w * diff.logprobs).sum(), params, allow_unused=True)
    want = torch.autograd.grad((w * response_logprobs(policy.model, plain)).sum(), params,
                               allow_unused=True)
    moved = 0.0
    for a, b in zip(got, want, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
            moved = max(moved, float(b.abs().max()))
    assert moved > 1e-3  # a real gradient, not zeros against zeros
    return plain


def test_differentiable_sampling_covers_eos_padding_and_env_tokens():
    """On the micro policy (float64): left padding and EOS-stopped rows (arith), tool output
    fed as context (toolsum), a fixed-length task (sort)."""
    micro = build_preset("micro", seed=0)
    policy = _float64_policy(micro.model, "micro")
    arith = _check_differentiable(policy, get_task("arith", digits=2),
                                  get_task("arith", digits=2).prompts(4, seed=1), 8, 3)
    assert (arith.prompt_mask == 0).any() and (arith.mask[..., -1] == 0).any()
    toolsum = get_task("toolsum")
    tool = _check_differentiable(policy, toolsum, toolsum.prompts(4, seed=1), 8, 3)
    assert tool.env_mask.sum() > 0
    _check_differentiable(policy, get_task("sort"), get_task("sort").prompts(3, seed=0), 5, 2)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "opt", "gpt_neox", "phi3", "gemma"])
def test_differentiable_sampling_over_the_architecture_matrix(arch):
    from _fixtures_arch import build

    policy = _float64_policy(build(arch, seed=5, attn="sdpa"), arch)
    task = get_task("arith", digits=2)
    _check_differentiable(policy, task, task.prompts(3, seed=2), 4, 1)


def test_differentiable_sampling_refuses_a_sliding_window_model():
    from _fixtures_arch import build

    from varbench.rollout import can_sample_differentiably

    model = build("mistral_sliding", seed=0)
    assert not can_sample_differentiably(model)
    assert can_sample_differentiably(build("llama", seed=0))
    policy = Policy(model=model, tokenizer=build_tokenizer(), name="sliding")
    task = get_task("sort")
    with pytest.raises(ValueError, match="differentiable=True.*'sliding'.*MistralForCausalLM"):
        sample(policy, task, task.prompts(2, seed=0), 2, differentiable=True)
    sample(policy, task, task.prompts(2, seed=0), 2)  # plain sampling still runs it


# ---- issue 29: the stop set (tokenizer eos | generation_config eos | the stop knob)
def _eot_setup(tmp_path, **kw):
    import _fixtures_user as fu

    from varbench.models import load_policy

    pol = load_policy(fu.eot_checkpoint(tmp_path / "ck", **kw))
    task = get_task(str(fu.word_jsonl(tmp_path / "w.jsonl")), max_new_tokens=24, chat="false")
    task.bind(pol.tokenizer)
    return pol, task, pol.tokenizer.convert_tokens_to_ids(fu.EOT)


def test_generation_config_eot_stops_responses(tmp_path):
    from varbench.rollout.sampler import stop_set

    pol, task, eot = _eot_setup(tmp_path)
    stops = stop_set(pol, task)[0]
    assert eot in stops and pol.tokenizer.eos_token == "<|end_of_text|>"
    b = sample(pol, task, task.prompts(2), 8, seed=0)
    toks, mask = b.tokens.reshape(16, -1), b.mask.reshape(16, -1)
    for row, m in zip(toks.tolist(), mask.tolist(), strict=True):
        n = int(sum(m))
        assert not set(row[:n - 1]) & set(stops)  # nothing scored after a stop token
        assert row[n - 1] in stops or n == 24
    assert b.meta["truncated"] == sum(1 for row, m in zip(toks.tolist(), mask.tolist(),
                                                          strict=True)
                                      if sum(m) == 24 and row[23] not in stops)


def test_without_generation_config_eot_runs_past_and_the_stop_knob_restores_it(tmp_path):
    pol, task, eot = _eot_setup(tmp_path, gen_eos=None)
    b = sample(pol, task, task.prompts(2), 8, seed=0)
    ran_past = sum(1 for row in b.tokens.reshape(16, -1).tolist() if eot in row[:-1])
    assert ran_past > 0  # the bug of the report: responses go on after their turn ended
    import _fixtures_user as fu

    t2 = get_task(str(tmp_path / "w.jsonl"), max_new_tokens=24, chat="false", stop=fu.EOT)
    t2.bind(pol.tokenizer)
    b2 = sample(pol, t2, t2.prompts(2), 8, seed=0)
    for row, n in zip(b2.tokens.reshape(16, -1).tolist(), b2.lengths.flatten().tolist(),
                      strict=True):
        assert eot not in row[:n - 1]


def test_text_stop_string_ends_a_response(tmp_path):
    pol, task, eot = _eot_setup(tmp_path, gen_eos=None, p_eot=0.01)
    t2 = get_task(str(tmp_path / "w.jsonl"), max_new_tokens=24, chat="false", stop=["a"])
    t2.bind(pol.tokenizer)
    b = sample(pol, t2, t2.prompts(2), 8, seed=0)
    for texts in b.texts:
        for x in texts:
            assert "a" not in x[:-1]
    assert int(b.lengths.max()) <= 24


def test_a_policy_with_no_stop_token_is_warned_and_truncation_counted(tmp_path):
    pol, task, eot = _eot_setup(tmp_path, gen_eos=None, tok_eos=None, p_eot=0.01)
    with pytest.warns(UserWarning, match="has no stop token"):
        b = sample(pol, task, task.prompts(1), 4, seed=0)
    assert b.meta["truncated"] == 4 and b.meta["stop_ids"] == []


@pytest.mark.parametrize("name,knobs", [("sort", {}), ("arith", {"digits": 2}), ("toolsum", {})])
def test_rows_in_chunks_equal_one_cache_in_float64(monkeypatch, name, knobs):
    """Rows sampled a chunk of prompts at a time (the memory plan's KV-cache rows, here from a
    faked device budget, and the explicit rows knob) give the unchunked batch: greedy tokens
    identical, statistics equal to float64 rounding. Sampled draws share one generator across
    the chunks, so only greedy decoding (and one chunk) can be identical by construction."""
    from varbench.models import memplan
    from varbench.rollout import sampler

    policy = build_preset("micro", seed=0)
    policy.model.to(torch.float64)
    task = get_task(name, **knobs)
    prompts = task.prompts(3, seed=4)
    G = 2
    whole = sample(policy, task, prompts, G, greedy=True)
    runs = []
    real = sampler._sample_rows
    monkeypatch.setattr(sampler, "_sample_rows",
                        lambda *a, **kw: runs.append(a[3].shape[0]) or real(*a, **kw))
    shape = memplan.ModelShape.from_model(policy.model)
    L = sampler.encode_prompts(policy.tokenizer, prompts)[0].shape[1] + task.max_new_tokens
    one = (memplan.fixed_bytes(shape, "sampling", 6, L) + G * memplan.unit_bytes(
        shape, "sampling", L)) / memplan.HEADROOM
    monkeypatch.setattr(memplan, "device_budget", lambda device, fraction=0.5: int(one) + 1)
    planned = sample(policy, task, prompts, G, greedy=True)
    assert runs == [1, 1, 1]  # the budget holds one group's cache: three caches
    knob = sample(policy, task, prompts, G, greedy=True, rows=4)
    assert runs[3:] == [2, 1]
    for got in (planned, knob):
        assert torch.equal(got.tokens, whole.tokens) and torch.equal(got.mask, whole.mask)
        assert torch.equal(got.env_mask, whole.env_mask)
        assert torch.equal(got.rewards, whole.rewards) and got.texts == whole.texts
        for x, y in ((got.logprobs, whole.logprobs), (got.sum_pi_sq, whole.sum_pi_sq),
                     (got.entropy, whole.entropy)):
            torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    # one chunk holding every row is the unchunked call, draws included
    a = sample(policy, task, prompts, G, seed=7, rows=6)
    monkeypatch.setattr(memplan, "device_budget", lambda device, fraction=0.5: None)
    b = sample(policy, task, prompts, G, seed=7)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)
    with pytest.raises(ValueError, match="rows"):
        sample(policy, task, prompts, G, rows=0)
