"""varbench.train.warmstart: lands in the accuracy band, caches by config hash, rebuilds corrupt
entries; the demonstration tokens and the SFT loss."""

from __future__ import annotations

import pytest
import torch

from varbench.models import build_preset, build_tokenizer, forward_logits
from varbench.tasks import get_task
from varbench.train import warmstart as ws
from varbench.train.warmstart import demo_tokens, sft_loss, warm_start

pytestmark = pytest.mark.usefixtures("one_thread")


SMALL_SORT = dict(n=2, max_value=5)


FAST = dict(eval_every=10, eval_prompts=48, max_steps=400, progress=False)


@pytest.fixture(scope="module")
def cached(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache")
    policy = warm_start("tiny", get_task("sort", **SMALL_SORT), cache_dir=root, **FAST)
    return root, policy


def test_lands_in_band_and_measures_sampled_accuracy(cached):
    _, policy = cached
    info = policy.meta["warmstart"]
    assert info["in_band"] and 0.2 <= info["accuracy"] <= 0.6
    # re-measure independently on other held-out draws: sampled accuracy is in a loose band
    acc = ws.heldout_accuracy(policy, get_task("sort", **SMALL_SORT), n_prompts=64, G=4,
                              seed=99)
    assert 0.05 <= acc <= 0.85


def test_second_call_loads_the_cache(cached, monkeypatch):
    root, first = cached
    monkeypatch.setattr(ws, "_train", lambda *a, **k: pytest.fail("retrained a cached config"))
    again = warm_start("tiny", get_task("sort", **SMALL_SORT), cache_dir=root, **FAST)
    sa, sb = first.model.state_dict(), again.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert again.meta["warmstart"]["accuracy"] == first.meta["warmstart"]["accuracy"]


def test_cache_key_covers_the_config(cached, monkeypatch):
    root, _ = cached
    calls = []
    real = ws._train

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(ws, "_train", spy)
    warm_start("tiny", get_task("sort", **SMALL_SORT), cache_dir=root, seed=1, **FAST)
    assert calls  # another seed is another entry
    assert len(list((root / "warmstart").iterdir())) == 2


def test_corrupt_cache_entry_is_rebuilt_with_a_warning(tmp_path):
    task = get_task("sort", **SMALL_SORT)
    first = warm_start("tiny", task, cache_dir=tmp_path, **FAST)
    entry = tmp_path / "warmstart"
    (weights,) = entry.glob("*/model.safetensors")
    weights.write_bytes(weights.read_bytes()[:50])
    with pytest.warns(UserWarning, match=r"cache entry .* is corrupt .*model\.safetensors"):
        again = warm_start("tiny", task, cache_dir=tmp_path, **FAST)
    sa, sb = first.model.state_dict(), again.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)  # rebuilt deterministically
    assert len(list(entry.iterdir())) == 1


def test_env_var_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("VARBENCH_CACHE", str(tmp_path / "vc"))
    assert ws.default_cache_dir() == tmp_path / "vc"


def test_out_of_band_warns(tmp_path):
    with pytest.warns(UserWarning, match="outside"):
        p = warm_start("micro", get_task("sort", **SMALL_SORT), target=(0.95, 1.0),
                       cache_dir=tmp_path, max_steps=4, eval_every=2, eval_prompts=8,
                       progress=False)
    assert not p.meta["warmstart"]["in_band"]


def test_demo_tokens_mask_tool_output():
    task, tok = get_task("toolsum", k=3), build_tokenizer()
    p = task.prompts(1, seed=0)[0]
    ids, mask, lp = demo_tokens(task, tok, p)
    want = tok(p.text + task.demonstration(p))["input_ids"] + [tok.eos_token_id]
    assert ids == want and len(mask) == len(ids)
    assert sum(mask[:lp]) == 0
    out_open, out_close = tok.convert_tokens_to_ids(["<out>", "</out>"])
    inside = False
    for i, m in zip(ids[lp:], mask[lp:], strict=False):
        inside = inside or i == out_open
        assert m == (0 if inside else 1)
        if i == out_close:
            inside = False
    s_ids, s_mask, s_lp = demo_tokens(get_task("sort"), tok, get_task("sort").prompts(1)[0])
    assert len(s_ids) - s_lp == 3 and s_mask[s_lp:] == [1, 1, 1]  # fixed length: no EOS


def test_sft_loss_matches_per_token_loop_float64():
    policy = build_preset("micro", seed=3, dtype=torch.float64)
    task = get_task("toolsum")
    ids, attn, tgt = ws._sft_batch(task, policy.tokenizer, task.prompts(3, seed=0), "cpu")
    got = sft_loss(policy.model, ids, attn, tgt)
    total, count = 0.0, 0
    for b in range(ids.shape[0]):
        n = int(attn[b].sum())
        z = forward_logits(policy.model, ids[b : b + 1, :n]).logits[0]
        for t in range(1, n):
            if tgt[b, t]:
                total -= torch.log_softmax(z[t - 1].double(), -1)[ids[b, t]].item()
                count += 1
    assert got.item() == pytest.approx(total / count, abs=1e-10)


def test_bad_input():
    task = get_task("sort")
    with pytest.raises(ValueError, match=r"preset='huge'.*tiny"):
        warm_start("huge", task, use_cache=False)
    with pytest.raises(ValueError, match="target"):
        warm_start("tiny", task, target=(0.6, 0.2), use_cache=False)
    with pytest.raises(ValueError, match=r"reward='nope'"):
        warm_start("tiny", task, reward="nope", use_cache=False)
    with pytest.raises(ValueError, match=r"task='nope'"):
        warm_start("tiny", "nope", use_cache=False)


def test_flipped_bit_is_rebuilt_and_unreadable_entry_is_not_deleted(tmp_path, monkeypatch):
    """Regression: flipped bits in a warm start's safetensors loaded silently; an entry another
    user cannot read was called corrupt, deleted and rebuilt."""
    from varbench._util.checks import UsageError

    task = get_task("sort", **SMALL_SORT)
    kw = dict(cache_dir=tmp_path, max_steps=4, eval_every=2, eval_prompts=8, progress=False,
              target=(0.0, 1.0))
    first = warm_start("micro", task, **kw)
    (weights,) = (tmp_path / "warmstart").glob("*/model.safetensors")
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x10
    weights.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match=r"corrupt .*model\.safetensors.*content hash"):
        again = warm_start("micro", task, **kw)
    sa, sb = first.model.state_dict(), again.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    import varbench._util.io as vio

    def denied(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(vio, "file_sha256", denied)
    monkeypatch.setattr(ws, "_train", lambda *a, **k: pytest.fail("rebuilt an unreadable entry"))
    with pytest.raises(UsageError, match="permission denied"):
        warm_start("micro", task, **kw)
    assert weights.exists()


def test_a_full_disk_while_caching_names_the_entry(tmp_path, monkeypatch, capsys):
    """ENOSPC while the warm-started policy is saved to the cache is an OSError naming the
    cache entry (a CLI exit 2 saying the path), and no half-written entry is left (issue 32)."""
    import errno

    from varbench.app.cli import main

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ws, "save_policy", full)
    with pytest.warns(UserWarning, match="outside"), pytest.raises(OSError) as err:
        warm_start("micro", get_task("sort", **SMALL_SORT), target=(0.95, 1.0),
                   cache_dir=tmp_path, max_steps=2, eval_every=2, eval_prompts=4,
                   progress=False)
    assert err.value.errno == errno.ENOSPC
    assert str(tmp_path / "warmstart") in err.value.filename
    assert not (tmp_path / "warmstart").exists() or not [
        p for p in (tmp_path / "warmstart").iterdir() if not p.name.startswith(".")]
    with pytest.warns(UserWarning, match="outside"):
        code = main(["warmstart", "--preset", "micro", "--knob", "n=2", "--knob", "max_value=5",
                     "--target", "0.95", "1.0", "--max-steps", "2", "--cache-dir",
                     str(tmp_path), "--device", "cpu"])
    assert code == 2
    msg = capsys.readouterr().err
    assert "No space left on device" in msg and str(tmp_path / "warmstart") in msg, msg
