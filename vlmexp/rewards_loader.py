"""From a config's reward entry to the callable GRPO, DPO's pair scoring and evaluation call: a registered
name (`vlmexp.rewards.REGISTRY`, the tool rewards' `vlmexp.tools.rewards.TOOL_REWARDS` and the model
rewards' `vlmexp.model_rewards.MODEL_REGISTRY`, joined in `REWARDS`) is built with its kwargs and the model
family's box frame; a `module:function` reward, the only way config text selects code to run, is imported
here (training) or, to validate a config, in a child Python process with a time limit
(`check_custom_reward`). Either comes back wrapped by `vlmexp.rewards.guarded`. Which records' answers the
configured rewards leave unscored is asked here too (`unscored_tasks`), where all three registries are known.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from vlmexp.errors import short
from vlmexp.model_rewards import MODEL_REGISTRY
from vlmexp.rewards import REGISTRY, DetectionReward, FormatReward, IoUReward, Score, guarded
from vlmexp.tools.rewards import TOOL_REWARDS, ToolReward, ZoomTargetReward

# the rewards computed by rules: on a completion's text, and on a tool run
RULES = {**REGISTRY, **TOOL_REWARDS}
# every registered name: the rule-based rewards and the model rewards
REWARDS = {**RULES, **MODEL_REGISTRY}
# the rewards that read boxes in the model family's frame (build_reward gives them the frame and the budget)
FRAMED = (IoUReward, DetectionReward, ToolReward, ZoomTargetReward)

IMPORT_TIMEOUT_ENV = "VLMEXP_REWARD_IMPORT_TIMEOUT"
DEFAULT_IMPORT_TIMEOUT = 120.0  # seconds; a module that imports torch and transformers takes ~5 s here


def unscored_tasks(tasks: set[str], names: list[str]) -> list[str]:
    """The records' tasks that none of the rewards `names` scores the answer of (the format reward scores only
    the form, the tool rewards the tool run). A module:function reward or a model reward (judge, reward_model)
    may score any task, so with one nothing is reported."""
    if any(name not in RULES for name in names):
        return []
    scored = {task for name in names for task in RULES[name].tasks}
    return sorted(tasks - scored)


def scoring_rewards(task: str) -> list[str]:
    """The built-in rewards that score `task`'s answers."""
    return [name for name, cls in RULES.items() if task in cls.tasks]


def _split_ref(ref: str) -> tuple[str, str]:
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr.isidentifier():
        raise ValueError(f"reward {ref!r} is neither a registered name "
                         f"({', '.join(REWARDS)}) nor module:function")
    return module_name, attr


def load_custom(ref: str) -> Callable[..., list[Score]]:
    """Import `module:function` in this process (training); the only way config text selects code to run.

    Whatever the module does when imported becomes a ValueError naming the reference: an exception, and
    also `sys.exit()` (which would otherwise end a training process with status 0, as if it had finished)."""
    module_name, attr = _split_ref(ref)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"reward {ref!r}: cannot import {module_name!r} ({e}); "
                         "is it on PYTHONPATH?") from None
    except (Exception, SystemExit) as e:  # noqa: BLE001
        # any failure of the user's module is reported by name
        raise ValueError(f"reward {ref!r}: importing {module_name!r} failed ({e.__class__.__name__}: {e}); "
                         f"fix the module") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward {ref!r}: {module_name} has no callable {attr!r}")
    return fn


_IMPORT_CHECK = """
import importlib, json, sys
path, module_name, attr, out = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
sys.path[:] = path
try:
    module = importlib.import_module(module_name)
    result = {"kind": "ok", "callable": callable(getattr(module, attr, None))}
except ImportError as e:
    result = {"kind": "import", "error": str(e)}
except SystemExit as e:
    result = {"kind": "exit", "error": repr(e.code)}
except BaseException as e:
    result = {"kind": "raise", "error": f"{e.__class__.__name__}: {e}"}
with open(out, "w") as f:
    json.dump(result, f)
"""


def check_custom_reward(ref: str) -> None:
    """Validate `module:function` by importing the module in a child Python process with a time limit
    (VLMEXP_REWARD_IMPORT_TIMEOUT seconds, default 120). Raises ValueError naming the reference.

    A child process, not a thread: the module's top-level code runs there, so nothing it does (raise,
    sys.exit, os._exit, loop forever, crash the interpreter, eat memory) can end or hang the process that
    validates, or make validation report success; a hung import is killed with its process group, which
    a thread could not be. It costs a Python start (~0.1 s) plus the module's own import time.
    """
    import json
    import os
    import signal
    import subprocess
    import sys
    import tempfile

    module_name, attr = _split_ref(ref)
    timeout = _import_timeout()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        proc = subprocess.Popen([sys.executable, "-c", _IMPORT_CHECK, json.dumps(sys.path), module_name,
                                 attr, out],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise ValueError(f"reward {ref!r}: importing {module_name!r} did not finish in {timeout:g} s "
                             "(validation imports the module, so its top-level code runs); make the import "
                             f"return, or set {IMPORT_TIMEOUT_ENV} higher") from None
        try:
            with open(out) as f:
                result = json.load(f)
        except (OSError, ValueError):
            raise ValueError(f"reward {ref!r}: importing {module_name!r} ended the Python process (exit "
                             f"status {code}) before it finished; remove what ends the process from the "
                             "module's top level") from None
    kind, error = result["kind"], short(result.get("error", ""), 300, text=True)
    if kind == "import":
        raise ValueError(f"reward {ref!r}: cannot import {module_name!r} ({error}); is it on PYTHONPATH?")
    if kind == "exit":
        raise ValueError(f"reward {ref!r}: importing {module_name!r} called sys.exit({error}); remove that "
                         "call from the module's top level")
    if kind == "raise":
        raise ValueError(f"reward {ref!r}: importing {module_name!r} raised {error}; fix the module")
    if not result["callable"]:
        raise ValueError(f"reward {ref!r}: {module_name} has no callable {attr!r}")


def _import_timeout() -> float:
    import os

    text = os.environ.get(IMPORT_TIMEOUT_ENV, "")
    try:
        value = float(text) if text else DEFAULT_IMPORT_TIMEOUT
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise ValueError(f"{IMPORT_TIMEOUT_ENV}={short(text)} is not a positive number of seconds; unset it "
                         "or give e.g. 300")
    return value


def check_reward_name(name: str, import_module: bool = True) -> None:
    """Raise ValueError (with the fix) unless `name` is registered or a well-formed module:function that
    imports (in a child process, `check_custom_reward`) and names a callable. `import_module=False`
    checks the form only (a config already validated)."""
    if name in REWARDS:
        return
    if ":" not in name:
        raise ValueError(f"unknown reward {name!r}: use one of {', '.join(REWARDS)} or module:function")
    _split_ref(name)
    if import_module:
        check_custom_reward(name)


def build_reward(name: str, kwargs: dict[str, Any], frame: str, budget: Any,
                 prefilled_think: bool = False) -> Callable[..., list[Score]]:
    """One reward callable from its config entry; `prefilled_think`: the chat template's generation prompt
    ends in <think> (the format reward's default for its `prefilled_think`)."""
    if name not in REWARDS:
        return guarded(load_custom(name), name)
    args = dict(kwargs)
    if issubclass(REWARDS[name], FRAMED):
        args.update(frame=frame, budget=budget)
    if REWARDS[name] is FormatReward and args.get("prefilled_think") is None:
        args["prefilled_think"] = prefilled_think
    try:
        reward = REWARDS[name](**args)
    except TypeError as e:
        raise ValueError(f"reward {name!r}: bad kwargs {kwargs} ({e})") from None
    return guarded(reward, name)
