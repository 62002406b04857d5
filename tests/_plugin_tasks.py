"""A user's task module for the tests: a Task subclass, a factory and things that are not
Tasks, named by MODULE:ATTR (``_plugin_tasks:EchoTask``; pytest puts tests/ on sys.path).

Not ``tests._plugin_tasks``: verl 0.9.1 installs a top-level regular package ``tests``, which
wins over this directory's namespace package."""

from __future__ import annotations

from varbench.tasks import Prompt, Task


class EchoTask(Task):
    """Repeat a word: a text task written the way docs/tasks.md describes."""

    name = "echo"
    knob_defaults = {"word": "hello"}

    def prompts(self, n, *, split="train", seed=0):
        return [Prompt(text=f"say {self.knobs['word']} {i}:", answer=self.knobs["word"],
                       meta={"i": i, "split": split}) for i in range(n)]

    def split_size(self, split):
        return None

    @property
    def max_new_tokens(self):
        return 4

    @property
    def alphabet(self):
        return ()

    def demonstration(self, prompt):
        return prompt.answer

    def score(self, prompt, response, reward=None):
        self.check_reward(reward)
        return float(response.strip() == prompt.answer)


def make_echo(word: str = "hi") -> Task:
    """A factory returning a Task."""
    return EchoTask(word=word)


NOT_A_TASK = 42


def not_a_factory():
    return "nope"


def raising_verifier(question, response, answer):
    """A user's verifier that fails on every other call's response length parity."""
    if len(response) % 2:
        raise RuntimeError("odd response")
    return 1.0
