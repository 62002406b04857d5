"""Dataset tasks: prompts with checkable answers read from a local data file.

    task = get_task("word_problems.jsonl", verifier="number", solution_key="solution")

Sources: ``.jsonl`` (one JSON object a line), ``.json`` (a list of objects), ``.csv`` (a header
row), ``.parquet`` (needs ``pyarrow``), or a directory written by ``datasets``'
``save_to_disk`` (a Dataset, or a DatasetDict whose splits are concatenated unless the ``split``
knob picks one). Knobs:

- ``prompt_key`` (default: the first of ``prompt``, ``question``, ``problem`` present),
  ``answer_key`` (``answer``), ``solution_key`` (optional: a correct response per row, the
  demonstrations of warm start);
- ``verifier``: ``exact``, ``number``, ``math``, ``choice`` or ``MODULE:FUNCTION``
  (:mod:`varbench.tasks.verifiers`); its score is the task's one reward, ``exact``;
- ``system`` (a system message), ``chat`` (``auto``: format prompts with the tokenizer's chat
  template when it has one; ``true``: require one; ``false``: plain text);
- ``max_new_tokens`` (response budget, default 64); ``heldout`` (held-out fraction, default
  0.2), ``split_seed``, ``split`` (a DatasetDict split to read), ``limit`` (first N rows, 0: all).

Splits: distinct prompt texts are ordered by a seeded hash of the text (``split_seed``) and the
first ``round(heldout * n)`` (at least 1) are held out. Rows with the same text share a split, so
train and held-out never share a problem, and reordering the file changes nothing.

Until the task is bound to a tokenizer (:meth:`DatasetTask.bind`, which every command does after
building the policy) a prompt's text is the plain format (system message, blank line, question).
"""

from __future__ import annotations

import csv
import hashlib
import json
import random
from pathlib import Path
from typing import Any

from varbench._util.checks import (
    UsageError,
    UsageFileNotFoundError,
    check_choice,
    check_positive_int,
)
from varbench.tasks.base import SPLITS, Prompt, Task
from varbench.tasks.verifiers import resolve_verifier, safe_score

EXTENSIONS = (".jsonl", ".json", ".csv", ".parquet")
PROMPT_KEYS = ("prompt", "question", "problem")
CHAT = ("auto", "true", "false")
# (resolved path, size, mtime ns, split) -> rows: a suite validates a task and then runs it
_ROWS_CACHE: dict[tuple, list[dict[str, Any]]] = {}


def looks_like_data(spec: str) -> bool:
    """Whether ``spec`` reads as a data path (a known extension, a directory, or a path
    separator) rather than a task name."""
    p = Path(str(spec)).expanduser()
    return p.suffix.lower() in EXTENSIONS or p.is_dir() or "/" in str(spec) or "\\" in str(spec)


def _fingerprint_files(path: Path) -> str:
    h = hashlib.sha256()
    files = sorted(x for x in path.rglob("*") if x.is_file()) if path.is_dir() else [path]
    for f in files:
        h.update(str(f.relative_to(path) if path.is_dir() else f.name).encode())
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]


def read_rows(path: str | Path, *, split: str = "") -> list[dict[str, Any]]:
    """The rows (dicts) of a data file or ``save_to_disk`` directory; UsageError on bad input."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UsageFileNotFoundError(
            f"task={str(path)!r}: no such file or directory; a task is a registered name, "
            f"MODULE:ATTR, or a data file ({', '.join(EXTENSIONS)}) or a datasets directory")
    st = p.stat()
    key = (str(p.resolve()), st.st_size, st.st_mtime_ns, split)
    if key not in _ROWS_CACHE:
        _ROWS_CACHE[key] = _read(p, split)
    return _ROWS_CACHE[key]


def _read(p: Path, split: str) -> list[dict[str, Any]]:
    if p.is_dir():
        return _read_saved(p, split)
    ext = p.suffix.lower()
    if split:
        raise UsageError(f"knob split={split!r} applies to a datasets directory; {str(p)!r} is "
                         "a file (its held-out rows come from the heldout fraction)")
    if ext == ".jsonl":
        rows = []
        with p.open(encoding="utf-8") as fh:
            for i, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise UsageError(f"task={str(p)!r}: line {i} is not valid JSON ({err})"
                                     ) from None
                if not isinstance(row, dict):
                    raise UsageError(f"task={str(p)!r}: line {i} is not a JSON object")
                rows.append(row)
        return rows
    if ext == ".json":
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise UsageError(f"task={str(p)!r}: not valid JSON ({err})") from None
        if isinstance(data, dict) and len(data) == 1 and isinstance(next(iter(data.values())),
                                                                     list):
            data = next(iter(data.values()))  # {"data": [...]}
        if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
            raise UsageError(f"task={str(p)!r}: expected a JSON list of objects")
        return data
    if ext == ".csv":
        with p.open(encoding="utf-8", newline="") as fh:
            return list(csv.DictReader(fh))
    if ext == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise UsageError(f"task={str(p)!r}: reading .parquet needs pyarrow; pip install "
                             "'varbench[data]'") from None
        try:
            return pq.read_table(p).to_pylist()
        except Exception as err:  # noqa: BLE001 - a corrupt file: name it
            raise UsageError(f"task={str(p)!r}: cannot read parquet file ({err})") from None
    raise UsageError(f"task={str(p)!r}: unknown data file extension {p.suffix!r}; choose one "
                     f"of {list(EXTENSIONS)} or a datasets save_to_disk directory")


def _read_saved(p: Path, split: str) -> list[dict[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise UsageError(f"task={str(p)!r} is a directory: reading save_to_disk data needs the "
                         "datasets package; pip install 'varbench[data]'") from None
    try:
        ds = datasets.load_from_disk(str(p))
    except Exception as err:  # noqa: BLE001 - not a datasets directory: say what it is not
        raise UsageError(f"task={str(p)!r}: not a datasets save_to_disk directory ({err})"
                         ) from None
    if isinstance(ds, datasets.DatasetDict):
        names = list(ds)
        if split:
            check_choice("knob split", split, names)
            return ds[split].to_list()
        return [row for n in names for row in ds[n].to_list()]
    if split:
        raise UsageError(f"knob split={split!r}: {str(p)!r} holds one Dataset, not a "
                         "DatasetDict with splits; drop the split knob")
    return ds.to_list()


class DatasetTask(Task):
    """A task whose prompts and answers are rows of a local data file (see the module doc)."""

    name = "dataset"
    rewards = ("exact",)
    knob_defaults = {
        "prompt_key": "", "answer_key": "answer", "solution_key": "", "verifier": "exact",
        "system": "", "chat": "auto", "max_new_tokens": 64, "heldout": 0.2, "split_seed": 0,
        "split": "", "limit": 0,
    }
    knob_help = {
        "prompt_key": "column of the question (default: first of prompt, question, problem)",
        "answer_key": "column of the answer (default answer)",
        "solution_key": "column of a correct response (demonstrations for warm start)",
        "verifier": "exact, number, math, choice or MODULE:FUNCTION(question, response, answer)",
        "system": "system message",
        "chat": "auto (use the tokenizer's chat template if any), true, false",
        "max_new_tokens": "response budget in tokens (default 64)",
        "heldout": "held-out fraction (default 0.2)",
        "split_seed": "seed of the hash that splits train / heldout",
        "split": "a DatasetDict split to read (default: all splits)",
        "limit": "use the first N rows only (0: all)",
    }

    def __init__(self, path: str | Path, **knobs: Any) -> None:
        self.path = Path(path).expanduser()
        self.spec = str(path)
        self.name = self.path.name  # instance name: reports say which file
        for k in ("chat",):  # TOML booleans for the yes/no knobs
            if isinstance(knobs.get(k), bool):
                knobs[k] = "true" if knobs[k] else "false"
        super().__init__(**knobs)
        self.verifier_errors = 0
        self.first_verifier_error: str | None = None
        self._tokenizer = None
        self._load()

    # ---- setup -------------------------------------------------------------------------------
    def _validate(self) -> None:
        k = self.knobs
        for name in ("prompt_key", "answer_key", "solution_key", "verifier", "system", "split"):
            if not isinstance(k[name], str):
                raise UsageError(f"task {self.spec!r} knob {name}={k[name]!r} is not valid; "
                                 "expected a string")
        check_choice(f"task {self.spec!r} knob chat", k["chat"], CHAT)
        check_positive_int(f"task {self.spec!r} knob max_new_tokens", k["max_new_tokens"])
        check_positive_int(f"task {self.spec!r} knob limit", k["limit"], minimum=0)
        check_positive_int(f"task {self.spec!r} knob split_seed", k["split_seed"], minimum=0)
        h = k["heldout"]
        if isinstance(h, bool) or not isinstance(h, (int, float)) or not 0 < h < 1:
            raise UsageError(f"task {self.spec!r} knob heldout={h!r} is not valid; expected a "
                             "fraction strictly between 0 and 1")
        self._verify = resolve_verifier(k["verifier"])

    def _load(self) -> None:
        k = self.knobs
        rows = read_rows(self.path, split=k["split"])
        if not rows:
            raise UsageError(f"task={self.spec!r}: the data set is empty (no rows)")
        if k["limit"]:
            rows = rows[: k["limit"]]
        columns = list(dict.fromkeys(c for r in rows[:100] for c in r))
        pkey = k["prompt_key"] or next((c for c in PROMPT_KEYS if c in columns), "")
        if not pkey or pkey not in columns:
            want = k["prompt_key"] or f"one of {list(PROMPT_KEYS)}"
            raise UsageError(f"task={self.spec!r}: no prompt column {want}; columns found: "
                             f"{columns}; set --knob prompt_key=COLUMN")
        for knob in ("answer_key", "solution_key"):
            col = k[knob]
            if col and col not in columns:
                raise UsageError(f"task={self.spec!r}: no {knob.split('_')[0]} column {col!r}; "
                                 f"columns found: {columns}; set --knob {knob}=COLUMN")
        self.prompt_key = pkey
        self.rows: list[tuple[str, str, str | None]] = []
        for i, r in enumerate(rows):
            q, a = r.get(pkey), r.get(k["answer_key"])
            if q is None or a is None or str(q) == "":
                raise UsageError(f"task={self.spec!r}: row {i} has no value for "
                                 f"{pkey if q is None or str(q) == '' else k['answer_key']!r}")
            sol = r.get(k["solution_key"]) if k["solution_key"] else None
            self.rows.append((str(q), str(a), None if sol is None else str(sol)))
        texts = sorted({q for q, _, _ in self.rows},
                       key=lambda t: hashlib.sha256(f"{k['split_seed']}:{t}".encode()).digest())
        if len(texts) < 2:
            raise UsageError(f"task={self.spec!r} has {len(texts)} distinct prompt(s); need at "
                             "least 2 for disjoint train / heldout splits")
        n_held = min(len(texts) - 1, max(1, round(len(texts) * k["heldout"])))
        held = set(texts[:n_held])
        self._pools = {"heldout": [i for i, r in enumerate(self.rows) if r[0] in held],
                       "train": [i for i, r in enumerate(self.rows) if r[0] not in held]}
        self._fingerprint = _fingerprint_files(self.path)

    def bind(self, tokenizer) -> None:
        """Format prompts for ``tokenizer`` (its chat template, per the ``chat`` knob); checks
        the template on one row now, so a failing template is an error before any work."""
        chat = self.knobs["chat"]
        has = bool(getattr(tokenizer, "chat_template", None))
        if chat == "true" and not has:
            raise UsageError(f"task {self.spec!r} knob chat=true: the tokenizer has no chat "
                             "template; use --knob chat=false or auto")
        self._tokenizer = tokenizer if (has and chat != "false") else None
        if self._tokenizer is not None:
            self._format(self.rows[0][0])

    def _format(self, question: str) -> str:
        system = self.knobs["system"]
        tok = self._tokenizer
        if tok is None:
            return f"{system}\n\n{question}\n" if system else f"{question}\n"
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": question}]
        try:
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as err:  # noqa: BLE001 - a user's Jinja template: report it
            raise UsageError(f"task {self.spec!r}: the tokenizer's chat template fails ({err}); "
                             "fix the template or use --knob chat=false") from None
        if not isinstance(text, str):
            raise UsageError(f"task {self.spec!r}: the chat template returned "
                             f"{type(text).__name__}, not text; use --knob chat=false")
        bos = getattr(tok, "bos_token", None)
        if bos and text.startswith(bos):
            ids = tok("x", add_special_tokens=True)["input_ids"]
            if ids and ids[0] == tok.bos_token_id:
                text = text[len(bos):]  # the tokenizer adds BOS itself when encoding
        return text

    # ---- the Task protocol -------------------------------------------------------------------
    def _make_prompt(self, data: tuple[int, ...]) -> Prompt:
        (i,) = data
        q, a, sol = self.rows[i]
        return Prompt(text=self._format(q), answer=a,
                      meta={"row": i, "question": q, "solution": sol})

    def _splits(self) -> dict[str, list[tuple[int, ...]]]:
        return {s: [(i,) for i in pool] for s, pool in self._pools.items()}

    def _space_size(self) -> int:
        return len(self.rows)

    def split_size(self, split: str) -> int:
        """Number of rows in ``split``."""
        check_choice("split", split, SPLITS)
        return len(self._pools[split])

    def prompts(self, n: int, *, split: str = "train", seed: int = 0) -> list[Prompt]:
        """``n`` rows of ``split`` drawn with ``random.Random(seed)`` (distinct while the split
        holds at least n rows, with replacement otherwise)."""
        check_positive_int("n", n)
        check_choice("split", split, SPLITS)
        pool = self._pools[split]
        rng = random.Random(f"{self._fingerprint}:{split}:{seed}")
        chosen = rng.sample(pool, n) if n <= len(pool) else [rng.choice(pool) for _ in range(n)]
        return [self._make_prompt((i,)) for i in chosen]

    @property
    def max_new_tokens(self) -> int:
        return int(self.knobs["max_new_tokens"])

    @property
    def alphabet(self) -> tuple[str, ...]:
        return ()  # free text: any tokenizer will do

    @property
    def has_demonstrations(self) -> bool:
        return bool(self.knobs["solution_key"])

    def demonstration(self, prompt: Prompt) -> str:
        sol = prompt.meta.get("solution")
        if sol is None:
            raise UsageError(f"task {self.spec!r} has no demonstrations; set --knob "
                             "solution_key=COLUMN (a correct response per row) to warm-start")
        return sol

    def score(self, prompt: Prompt, response: str, reward: str | None = None) -> float:
        """The verifier's score; 0 (and one more ``verifier_errors``) when it fails."""
        self.check_reward(reward)
        question = prompt.meta.get("question", prompt.text)
        value, err = safe_score(self._verify, self.knobs["verifier"], question, str(response),
                                prompt.answer)
        if err is not None:
            self.verifier_errors += 1
            if self.first_verifier_error is None:
                self.first_verifier_error = err
        return value

    def fingerprint(self) -> str:
        """Name, knobs and a hash of the data: what a cached result depends on."""
        return f"{super().fingerprint()}:{self._fingerprint}"

    def describe(self) -> str:
        return (f"{self.spec} (dataset, {len(self.rows)} rows: {self.split_size('train')} train"
                f" / {self.split_size('heldout')} heldout; prompt column {self.prompt_key!r}) "
                f"verifier={self.knobs['verifier']}")
