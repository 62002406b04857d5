"""Every public name of ``varbench`` resolves to the object it names, whatever the import order.

The bug was order-dependent: importing the package ``varbench.train`` bound it as the attribute
``varbench.train``, so ``from varbench import TrainConfig, train`` returned the module and
``train(config)`` raised "'module' object is not callable". One fresh interpreter (an import of
torch and transformers costs seconds) tries the orders that matter: the reported one first,
then every subpackage imported (each binding its name on the package), then every name again.
"""

from __future__ import annotations

import json
import subprocess
import sys

import varbench

_SCRIPT = r"""
import importlib, json, sys, types
first, pre = json.loads(sys.argv[1]), json.loads(sys.argv[2])
bad = []

def check(names, when):
    import varbench
    for name in names:
        ns = {}
        exec(f"from varbench import {name} as obj", ns)
        if name == "__version__":
            continue
        want = getattr(importlib.import_module(varbench._EXPORTS[name]), name)
        got = ns["obj"]
        if (got is not want or isinstance(got, types.ModuleType)
                or getattr(varbench, name) is not want):
            bad.append([when, name, repr(got)])

check(first, "fresh interpreter")
for m in pre:
    importlib.import_module(m)
import varbench
check(list(varbench.__all__), "after every subpackage")
from varbench.train import TrainConfig, loop
from varbench.train.loop import train as t
if varbench.train is not t or TrainConfig is not varbench.TrainConfig or loop.train is not t:
    bad.append(["dotted imports", "varbench.train.loop", "not the same objects"])
print(json.dumps(bad))
"""

_SUBPACKAGES = ["varbench.train", "varbench.train.loop", "varbench.train.warmstart",
                "varbench.app", "varbench.app.runner", "varbench.testing",
                "varbench.testing.check", "varbench.estimators", "varbench.estimators.schemes",
                "varbench.models", "varbench.models.presets", "varbench.report",
                "varbench.analysis", "varbench.grads", "varbench.rollout", "varbench.tasks"]


def test_public_names_in_the_reported_order_and_after_every_subpackage():
    names = list(varbench.__all__)
    assert names.index("TrainConfig") < names.index("train")
    first = ["TrainConfig", "train"] + [n for n in names if n not in ("TrainConfig", "train")]
    out = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(first),
                          json.dumps(_SUBPACKAGES)], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []
