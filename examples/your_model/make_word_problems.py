"""Write a small data set of arithmetic word problems as JSONL (our own templates, seeded).

    python examples/your_model/make_word_problems.py out.jsonl --rows 300 --seed 0

Each row: ``question`` (the problem), ``answer`` (the number), ``solution`` (a worked response
ending in "The answer is N."; demonstrations for warm start) and ``kind`` (which template).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ["Mia", "Leo", "Ava", "Noah", "Zoe", "Omar", "Ines", "Kai", "Lena", "Ravi"]
ITEMS = ["apples", "marbles", "stickers", "pencils", "coins", "shells", "books", "cards"]


def _problem(rng: random.Random) -> dict:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.choice(["add", "sub", "mul", "two_step"])
    if kind == "add":
        a, b = rng.randint(2, 40), rng.randint(2, 40)
        q = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?"
        ans, work = a + b, f"{a} + {b} = {a + b}."
    elif kind == "sub":
        a = rng.randint(10, 60)
        b = rng.randint(1, a - 1)
        q = f"{name} had {a} {item} and gave away {b}. How many {item} are left?"
        ans, work = a - b, f"{a} - {b} = {a - b}."
    elif kind == "mul":
        a, b = rng.randint(2, 9), rng.randint(2, 12)
        q = f"{name} fills {a} boxes with {b} {item} each. How many {item} is that in total?"
        ans, work = a * b, f"{a} x {b} = {a * b}."
    else:
        a, b, c = rng.randint(5, 30), rng.randint(2, 20), rng.randint(1, 5)
        q = (f"{name} has {a} {item}, finds {b} more, then loses {c}. How many {item} does "
             f"{name} have?")
        ans, work = a + b - c, f"{a} + {b} = {a + b}. {a + b} - {c} = {a + b - c}."
    return {"question": q, "answer": str(ans), "solution": f"{work} The answer is {ans}.",
            "kind": kind}


def make_rows(n: int, seed: int = 0) -> list[dict]:
    """``n`` distinct problems drawn with ``random.Random(seed)``."""
    rng = random.Random(seed)
    rows, seen = [], set()
    while len(rows) < n:
        row = _problem(rng)
        if row["question"] not in seen:
            seen.add(row["question"])
            rows.append(row)
    return rows


def write_jsonl(path: str | Path, n: int = 300, seed: int = 0) -> Path:
    """Write ``n`` problems to ``path`` (JSONL); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for row in make_rows(n, seed):
            fh.write(json.dumps(row) + "\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="output .jsonl file")
    ap.add_argument("--rows", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(f"wrote {args.rows} rows to {write_jsonl(args.out, args.rows, args.seed)}")


if __name__ == "__main__":
    main()
