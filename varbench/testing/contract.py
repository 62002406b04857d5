"""Deterministic contract checks of an advantage estimator (no statistics involved).

Each check returns one table row: ``{"check", "passed", "value", "detail"}``. An estimator that
raises is a failed row carrying the exception text, never a crash of the checker.

- shape/mask contract: a floating tensor ``[P, G, T]``, finite, exactly 0 where ``mask == 0``,
  inputs left unmodified;
- permutation equivariance: permuting responses within each group permutes the output;
- masked-value leakage: values under ``mask == 0`` (in token statistics) and extra padding
  columns change nothing;
- all-agree groups: equal rewards give 0 at every position reached by at least two responses
  (docs/science.md §2.1: such a group teaches nothing; OTB's zero-tail positions, reached by a
  single response, are exempt);
- finiteness on edges: G = 1, near-constant rewards (1.0 vs 1.00001 in float32), very long
  responses, empty responses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Row = dict[str, Any]


def random_batch(
    P: int, G: int, T: int, gen: torch.Generator, *, min_len: int = 1, dtype=torch.float32
) -> dict[str, torch.Tensor]:
    """Rewards in {0, 0.5, 1} [P, G], right-padded mask [P, G, T] with random lengths, and
    plausible per-token statistics (logprobs <= 0, sum_pi_sq in (0, 1]) that are 0 off the mask."""
    lengths = torch.randint(min_len, T + 1, (P, G), generator=gen)
    mask = (torch.arange(T) < lengths.unsqueeze(-1)).to(dtype)
    rewards = torch.randint(0, 3, (P, G), generator=gen).to(dtype) / 2
    logprobs = -torch.rand(P, G, T, generator=gen, dtype=dtype) * 3 * mask
    sum_pi_sq = (0.05 + 0.95 * torch.rand(P, G, T, generator=gen, dtype=dtype)) * mask
    return {"rewards": rewards, "mask": mask, "logprobs": logprobs, "sum_pi_sq": sum_pi_sq}


def _run(call: Callable, b: dict[str, torch.Tensor]) -> torch.Tensor:
    kw = {k: v for k, v in b.items() if k not in ("rewards", "mask")}
    out = call(b["rewards"], b["mask"], **kw)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"estimator returned {type(out).__name__}, expected a torch.Tensor")
    return out


def _row(check: str, passed: bool, value: float | None, detail: str) -> Row:
    return {"check": check, "passed": bool(passed), "value": value, "detail": detail}


def _guard(check: str, fn: Callable[[], Row]) -> Row:
    try:
        return fn()
    except Exception as err:  # the estimator under test may raise anything
        return _row(check, False, None, f"estimator raised {type(err).__name__}: {err}")


def _tol(out: torch.Tensor) -> float:
    return 1e-5 * (1.0 + float(out.detach().abs().max())) if out.numel() else 1e-5


def shape_and_mask(call: Callable, gen: torch.Generator) -> Row:
    """Output is a finite floating [P, G, T] tensor, exactly 0 off the mask; inputs unchanged."""

    def go() -> Row:
        b = random_batch(3, 4, 7, gen)
        before = {k: v.clone() for k, v in b.items()}
        out = _run(call, b)
        want = list(b["mask"].shape)
        if list(out.shape) != want or not out.is_floating_point():
            return _row("shape/mask contract", False, None,
                        f"returned {out.dtype} {list(out.shape)}, expected floating {want}")
        changed = [k for k in b if not torch.equal(b[k], before[k])]
        if changed:
            return _row("shape/mask contract", False, None, f"modified its inputs {changed}")
        if not bool(torch.isfinite(out).all()):
            return _row("shape/mask contract", False, None, "non-finite advantages")
        off = float(out.detach()[b["mask"] == 0].abs().max()) if (b["mask"] == 0).any() else 0.0
        return _row("shape/mask contract", off == 0.0, off,
                    "max |A| where mask == 0 (must be exactly 0)")

    return _guard("shape/mask contract", go)


def permutation(call: Callable, gen: torch.Generator) -> Row:
    """A different random permutation of each group's responses permutes the output alike."""

    def go() -> Row:
        b = random_batch(4, 5, 6, gen)
        out = _run(call, b)
        perm = torch.stack([torch.randperm(5, generator=gen) for _ in range(4)])  # [P, G]
        pb = {k: torch.gather(v, 1, perm.view(4, 5, *[1] * (v.dim() - 2)).expand_as(v))
              for k, v in b.items()}
        pout = _run(call, pb)
        expect = torch.gather(out, 1, perm.unsqueeze(-1).expand_as(out))
        err = float((pout - expect).abs().max())
        return _row("permutation equivariance", err <= _tol(out), err,
                    "max |A(perm x) - perm A(x)|")

    return _guard("permutation equivariance", go)


def leakage(call: Callable, gen: torch.Generator) -> Row:
    """Randomising token statistics under mask 0 and adding 3 padding columns change nothing."""

    def go() -> Row:
        b = random_batch(3, 4, 6, gen)
        out = _run(call, b)
        off = b["mask"] == 0
        noisy = dict(b)
        noisy["logprobs"] = torch.where(off, -3 * torch.rand(off.shape, generator=gen),
                                        b["logprobs"])
        noisy["sum_pi_sq"] = torch.where(off, torch.rand(off.shape, generator=gen),
                                         b["sum_pi_sq"])
        err_noise = float((_run(call, noisy) - out).abs().max())
        padded = {k: torch.nn.functional.pad(v, (0, 3)) if v.dim() == 3 else v
                  for k, v in b.items()}
        pout = _run(call, padded)
        err_pad = max(float((pout[..., :6] - out).abs().max()),
                      float(pout[..., 6:].abs().max()))
        err = max(err_noise, err_pad)
        return _row("masked-value leakage", err <= _tol(out), err,
                    f"max change: masked values {err_noise:.3g}, padding columns {err_pad:.3g}")

    return _guard("masked-value leakage", go)


def all_agree(call: Callable, gen: torch.Generator) -> Row:
    """Groups with equal rewards (0, 1 and 0.37) give 0 where >= 2 responses are running."""

    def go() -> Row:
        b = random_batch(3, 4, 6, gen, min_len=2)
        b["rewards"] = torch.tensor([0.0, 1.0, 0.37]).unsqueeze(-1).expand(3, 4).contiguous()
        out = _run(call, b)
        shared = b["mask"].sum(1, keepdim=True) >= 2  # [P, 1, T]
        sel = (shared & (b["mask"] > 0))
        err = float(out.detach()[sel].abs().max())
        return _row("all-agree groups", err <= _tol(out), err,
                    "max |A| in all-agree groups where >= 2 responses run")

    return _guard("all-agree groups", go)


def edges(call: Callable, gen: torch.Generator) -> list[Row]:
    """Finite output (and 0 on empty responses) for G = 1, near-constant, long and empty."""
    rows = []

    def finite(check: str, b: dict[str, torch.Tensor], detail: str) -> Row:
        def go() -> Row:
            out = _run(call, b)
            ok = list(out.shape) == list(b["mask"].shape) and bool(torch.isfinite(out).all())
            empty = b["mask"].sum(-1) == 0
            if ok and bool(empty.any()):
                ok = float(out.detach()[empty].abs().max()) == 0.0
            return _row(check, ok, float(out.detach().abs().max()), detail)

        return _guard(check, go)

    rows.append(finite("edge: G = 1", random_batch(3, 1, 5, gen), "max |A| (must be finite)"))
    near = random_batch(2, 4, 5, gen)
    near["rewards"] = torch.tensor([[1.0, 1.00001, 1.0, 1.00001], [1.0, 1.0, 1.0, 1.00001]])
    rows.append(finite("edge: near-constant rewards", near, "rewards 1.0 vs 1.00001 (float32)"))
    rows.append(finite("edge: long responses", random_batch(2, 4, 4096, gen, min_len=2048),
                       "T = 4096"))
    empty = random_batch(3, 4, 5, gen)
    empty["mask"][0, 1] = 0
    empty["mask"][2, :3] = 0  # a group with one running response
    for k in ("logprobs", "sum_pi_sq"):
        empty[k] = empty[k] * empty["mask"]
    rows.append(finite("edge: empty responses", empty, "must be finite and 0 on empty rows"))
    return rows


def contract_rows(call: Callable, seed: int) -> list[Row]:
    """All deterministic checks, seeded."""
    gen = torch.Generator().manual_seed(seed)
    return [shape_and_mask(call, gen), permutation(call, gen), leakage(call, gen),
            all_agree(call, gen), *edges(call, gen)]
