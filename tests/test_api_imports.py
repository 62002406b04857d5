"""Every public name of ``varbench`` resolves to the object it names, whatever the import order.

Each order runs in a fresh interpreter (the bug was order-dependent: importing the package
``varbench.train`` used to rebind ``varbench.train`` to the module, so ``from varbench import
TrainConfig, train`` returned the module and ``train(config)`` raised "'module' object is not
callable").
"""

from __future__ import annotations

import json
import subprocess
import sys

import varbench

_SCRIPT = r"""
import importlib, json, sys, types
order = json.loads(sys.argv[1])
pre = json.loads(sys.argv[2])
for m in pre:
    importlib.import_module(m)
import varbench
bad = []
for name in order:
    ns = {}
    exec(f"from varbench import {name} as obj", ns)
    obj = ns["obj"]
    if name == "__version__":
        continue
    want = getattr(importlib.import_module(varbench._EXPORTS[name]), name)
    if obj is not want or isinstance(obj, types.ModuleType) or getattr(varbench, name) is not want:
        bad.append([name, repr(obj)])
if pre:  # the packages stay importable by their dotted names
    from varbench.train import TrainConfig
    from varbench.train.loop import train as t
    if varbench.train is not t or TrainConfig is not varbench.TrainConfig:
        bad.append(["varbench.train.loop", "not the same objects"])
print(json.dumps(bad))
"""

_SUBPACKAGES = ["varbench.train", "varbench.train.loop", "varbench.app", "varbench.app.runner",
                "varbench.testing", "varbench.testing.check", "varbench.estimators",
                "varbench.models", "varbench.models.presets", "varbench.report",
                "varbench.analysis", "varbench.grads", "varbench.rollout", "varbench.tasks"]


def _run(order: list[str], pre: list[str]) -> list:
    out = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(order), json.dumps(pre)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_every_name_in_order_and_after_every_subpackage():
    names = list(varbench.__all__)
    assert names.index("TrainConfig") < names.index("train")  # the order of the bug report
    assert _run(names, []) == []
    # (reverse order adds nothing: a name read before any subpackage import was always right)
    assert _run(names, _SUBPACKAGES) == []  # every subpackage bound first
