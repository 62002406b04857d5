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
import io
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
from varbench._util.io import jsonl_rows, parquet_rows
from varbench.tasks.base import SPLITS, Prompt, Task
from varbench.tasks.verifiers import (
    UnreadableNumber,
    final_number,
    has_math_verify,
    pick_verifier,
    resolve_verifier,
    safe_score,
)

EXTENSIONS = (".jsonl", ".json", ".csv", ".parquet")
PROMPT_KEYS = ("prompt", "question", "problem")
CHAT = ("auto", "true", "false")
# held-out split of a DatasetDict read without the split knob, first present wins
HELDOUT_SPLITS = ("test", "validation")
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
    """The rows (dicts) of a data file or ``save_to_disk`` directory; UsageError on bad input.

    A DatasetDict directory read without ``split`` gives its ``train`` split followed by its
    held-out split (:data:`HELDOUT_SPLITS`); :func:`read_split_rows` says which row is which.
    """
    return read_split_rows(path, split=split)[0]


def read_split_rows(path: str | Path, *, split: str = ""
                    ) -> tuple[list[dict[str, Any]], tuple[str, int] | None]:
    """``(rows, held)``: the rows of :func:`read_rows`, and when they come from a
    DatasetDict's ``train`` and held-out split, ``held = (held-out split name, number of train
    rows)`` (the train rows come first), else None."""
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


def _text(p: Path) -> str:
    """The file decoded as UTF-8; a byte that is not UTF-8 is a one-line error naming its line."""
    data = p.read_bytes()
    try:
        return data.decode("utf-8-sig")  # a UTF-8 byte-order mark (Excel's CSV) is dropped
    except UnicodeDecodeError as err:
        line = data[:err.start].count(b"\n") + 1
        raise UsageError(
            f"task={str(p)!r}: line {line} is not UTF-8 (byte {data[err.start]:#04x} at offset "
            f"{err.start}); save the file as UTF-8") from None


def _read_csv(p: Path, text: str) -> list[dict[str, Any]]:
    """A CSV with a header row read by pyarrow: every column as text (``007`` stays ``007``),
    an empty cell as null (the missing-value rule refuses it where it matters)."""
    try:
        import pyarrow as pa
        import pyarrow.csv as pcsv
    except ImportError:
        raise UsageError(f"task={str(p)!r}: reading .csv needs pyarrow; pip install "
                         "'varbench[data]'") from None
    header = next(csv.reader(io.StringIO(text)), [])
    if not header:
        return []
    if len(set(header)) != len(header):
        raise UsageError(f"task={str(p)!r}: the header row repeats a column name: {header}")
    try:
        table = pcsv.read_csv(
            pa.BufferReader(text.encode("utf-8")),
            parse_options=pcsv.ParseOptions(newlines_in_values=True),
            convert_options=pcsv.ConvertOptions(
                column_types={c: pa.string() for c in header}, strings_can_be_null=True,
                quoted_strings_can_be_null=False))
    except Exception as err:  # noqa: BLE001 - pyarrow's message names the row: one line
        msg = " ".join(str(err).split())
        raise UsageError(f"task={str(p)!r}: cannot read the CSV ({msg})") from None
    return table.to_pylist()


def _read(p: Path, split: str) -> tuple[list[dict[str, Any]], tuple[str, int] | None]:
    if p.is_dir():
        return _read_saved(p, split)
    ext = p.suffix.lower()
    if split:
        raise UsageError(f"knob split={split!r} applies to a datasets directory; {str(p)!r} is "
                         "a file (its held-out rows come from the heldout fraction)")
    if ext == ".jsonl":
        return jsonl_rows(p, _text(p), what="task"), None
    if ext == ".json":
        try:
            data = json.loads(_text(p))
        except json.JSONDecodeError as err:
            raise UsageError(f"task={str(p)!r}: not valid JSON ({err})") from None
        if isinstance(data, dict) and len(data) == 1 and isinstance(next(iter(data.values())),
                                                                     list):
            data = next(iter(data.values()))  # {"data": [...]}
        if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
            raise UsageError(f"task={str(p)!r}: expected a JSON list of objects")
        return data, None
    if ext == ".csv":
        return _read_csv(p, _text(p)), None
    if ext == ".parquet":
        return parquet_rows(p, what="task", extra="data"), None
    raise UsageError(f"task={str(p)!r}: unknown data file extension {p.suffix!r}; choose one "
                     f"of {list(EXTENSIONS)} or a datasets save_to_disk directory")


def _read_saved(p: Path, split: str) -> tuple[list[dict[str, Any]], tuple[str, int] | None]:
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
            return ds[split].to_list(), None
        held = next((n for n in HELDOUT_SPLITS if n in names), None)
        if "train" in names and held is not None:
            train = ds["train"].to_list()
            return train + ds[held].to_list(), (held, len(train))
        if names == ["train"]:
            return ds["train"].to_list(), None
        # splits of unknown roles are never mixed: a test row must not reach training
        raise UsageError(f"task={str(p)!r} is a DatasetDict with splits {names}, not 'train' "
                         f"and one of {list(HELDOUT_SPLITS)}; choose one with --knob split=NAME "
                         "(its held-out rows then come from the heldout fraction)")
    if split:
        raise UsageError(f"knob split={split!r}: {str(p)!r} holds one Dataset, not a "
                         "DatasetDict with splits; drop the split knob")
    return ds.to_list(), None


def _missing(value: Any) -> bool:
    """The one missing-value rule of every format: absent, null (JSON null, Parquet null, an
    empty CSV cell, NaN) or text that is empty after stripping."""
    if value is None:
        return True
    if isinstance(value, float) and value != value:  # NaN: pandas' missing value
        return True
    return isinstance(value, str) and not value.strip()


class DatasetTask(Task):
    """A task whose prompts and answers are rows of a local data file (see the module doc)."""

    name = "dataset"
    rewards = ("exact",)
    knob_defaults = {
        "prompt_key": "", "answer_key": "answer", "solution_key": "", "verifier": "auto",
        "system": "", "chat": "auto", "max_new_tokens": 64, "heldout": 0.2, "split_seed": 0,
        "split": "", "limit": 0, "stop": [],
    }
    knob_help = {
        "prompt_key": "column of the question (default: first of prompt, question, problem)",
        "answer_key": "column of the answer (default answer)",
        "solution_key": "column of a correct response (demonstrations for warm start)",
        "verifier": "auto (chosen from the answers), exact, number, math, choice or "
                    "MODULE:FUNCTION(question, response, answer)",
        "system": "system message",
        "chat": "auto (use the tokenizer's chat template if any), true, false",
        "max_new_tokens": "response budget in tokens (default 64)",
        "heldout": "held-out fraction (default 0.2)",
        "split_seed": "seed of the hash that splits train / heldout",
        "split": "a DatasetDict split to read (default: train, held out from test or "
                 "validation)",
        "limit": "use the first N rows only (0: all)",
        "stop": "strings (or tokens) that end a response, besides the tokenizer's and the "
                "checkpoint's eos (a string or a list)",
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
        stop = [k["stop"]] if isinstance(k["stop"], str) else k["stop"]
        if not isinstance(stop, (list, tuple)) or not all(isinstance(x, str) and x
                                                          for x in stop):
            raise UsageError(f"task {self.spec!r} knob stop={k['stop']!r} is not valid; "
                             "expected a non-empty string or a list of them")
        k["stop"] = list(stop)
        h = k["heldout"]
        if isinstance(h, bool) or not isinstance(h, (int, float)) or not 0 < h < 1:
            raise UsageError(f"task {self.spec!r} knob heldout={h!r} is not valid; expected a "
                             "fraction strictly between 0 and 1")
        self._verify = None if k["verifier"] == "auto" else resolve_verifier(k["verifier"])
        self.verifier = k["verifier"]  # the verifier used: 'auto' resolves in _load

    def _load(self) -> None:
        k = self.knobs
        rows, dict_split = read_split_rows(self.path, split=k["split"])
        if not rows:
            raise UsageError(f"task={self.spec!r}: the data set is empty (no rows)")
        # DatasetDict: rows of 'train' first, then those of its held-out split
        held_split, n_train = dict_split if dict_split is not None else (None, None)
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
        cols = [(pkey, "prompt"), (k["answer_key"], "answer")]
        if k["solution_key"]:
            cols.append((k["solution_key"], "solution"))
        for i, r in enumerate(rows):
            for col, role in cols:
                if _missing(r.get(col)):
                    raise UsageError(
                        f"task={self.spec!r}: row {i + 1} has no {role} (column {col!r} is "
                        f"{'missing' if col not in r else repr(r.get(col))}); every row needs a "
                        "non-empty prompt and answer: fill it or drop the row")
            sol = r.get(k["solution_key"]) if k["solution_key"] else None
            self.rows.append((str(r[pkey]), str(r[k["answer_key"]]),
                              None if sol is None else str(sol)))
        if self._verify is None:  # auto: chosen from the answer column
            self.verifier = pick_verifier([a for _, a, _ in self.rows])
            self._verify = resolve_verifier(self.verifier)
        if self.verifier == "number":
            self._check_numbers()
        texts = sorted({q for q, _, _ in self.rows},
                       key=lambda t: hashlib.sha256(f"{k['split_seed']}:{t}".encode()).digest())
        if len(texts) < 2:
            raise UsageError(f"task={self.spec!r} has {len(texts)} distinct prompt(s); need at "
                             "least 2 for disjoint train / heldout splits")
        if n_train is not None and n_train < len(self.rows):
            # a DatasetDict's own split: train rows from 'train', held-out from its test split;
            # a problem in both is held out (train and held-out never share a problem)
            held = {r[0] for r in self.rows[n_train:]}
            self.heldout_source = held_split
        else:
            n_held = min(len(texts) - 1, max(1, round(len(texts) * k["heldout"])))
            held = set(texts[:n_held])
            self.heldout_source = None
        self._pools = {"heldout": [i for i, r in enumerate(self.rows) if r[0] in held],
                       "train": [i for i, r in enumerate(self.rows) if r[0] not in held]}
        if not self._pools["train"]:
            raise UsageError(f"task={self.spec!r}: every 'train' problem is also in the "
                             f"held-out split {held_split!r}; nothing is left to train on")
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

    def _check_numbers(self) -> None:
        """verifier=number: every answer must have a final number it reads (else say so now,
        not as a 0 on every response)."""
        for i, (_, a, _) in enumerate(self.rows):
            try:
                ok = final_number(a) is not None
            except UnreadableNumber:
                ok = has_math_verify()
            if not ok:
                raise UsageError(
                    f"task={self.spec!r}: verifier=number cannot read a number in the answer "
                    f"of row {i + 1} ({a[-60:]!r}); choose verifier=math, exact or choice")

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return tuple(self.knobs["stop"])

    def scoring_hint(self) -> str:
        """What to check when every reward is 0: the verifier and the prompt format."""
        fmt = ("the tokenizer's chat template" if self._tokenizer is not None else
               "plain text (no chat template)")
        return (f"verifier {self.verifier!r} (--knob verifier=number|math|exact|choice) on "
                f"answers like {self.rows[0][1][:40]!r}, or the prompts' format ({fmt}; "
                "--knob chat=...)")

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
        value, err = safe_score(self._verify, self.verifier, question, str(response),
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
                f"verifier={self.verifier}"
                f"{' (auto)' if self.knobs['verifier'] == 'auto' else ''}"
                f"{f'; held out: split {self.heldout_source!r}' if self.heldout_source else ''}")
