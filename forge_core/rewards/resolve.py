"""Reward functions by name: the built-ins (forge_core.rewards.registry), optional ones backed by a package, and
user functions given by import path.

    spec = resolve_reward("exact_answer")                 # RewardSpec(name, fn, version)
    spec = resolve_reward("my_pkg.rewards:brevity")       # fn(completion, ground_truth, **kwargs) -> float
    spec.fn("<answer>0168</answer>", "0168")              # 1.0

Every function carries a version that is stored with the rollouts and is part of the content key of every
stage that scores, so a changed scorer is never served stale results. A built-in's is set at registration; a
user function's is its `version` attribute, else a hash of its whole module's source, read from disk when resolved.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import re
from collections.abc import Callable
from pathlib import Path

# The built-in functions register themselves when their module is imported.
from forge_core.rewards import builtin  # noqa: F401
from forge_core.rewards.registry import OptionalReward, RewardSpec, registered, registered_names

_IMPORT_PATH_RE = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*$")


def builtin_reward_names() -> list[str]:
    """Every built-in name, including optional rewards whose package may be missing."""
    return registered_names()


def resolve_reward(name: str) -> RewardSpec:
    """The reward function for a registered name or a `package.module:function` import path.

    Raises:
        ValueError: naming the reward and the fix, for an unknown name, a missing optional package, an import
            path that does not import, or an object that is not callable.
    """
    known = registered(name)
    if isinstance(known, RewardSpec):
        return known
    if isinstance(known, OptionalReward):
        return _resolve_optional(name, known)
    if ":" in name:
        return _resolve_import_path(name)
    raise ValueError(
        f"reward {name!r}: unknown; use one of {builtin_reward_names()} or your own function as "
        "'package.module:function' (signature fn(completion: str, ground_truth: str, **kwargs) -> float)"
    )


def _resolve_optional(name: str, optional: OptionalReward) -> RewardSpec:
    if importlib.util.find_spec(optional.module) is None:
        raise ValueError(
            f"reward {name!r} needs the {optional.distribution!r} package, which is not installed; "
            f"run `pip install {optional.distribution}` (or `pip install 'forgeflow[math]'`) or drop the "
            f"{name!r} reward component"
        )
    try:
        version = importlib.metadata.version(optional.distribution)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return RewardSpec(name=name, fn=optional.factory(), version=f"{optional.distribution}=={version}")


def _resolve_import_path(path: str) -> RewardSpec:
    if not _IMPORT_PATH_RE.match(path):
        raise ValueError(
            f"reward {path!r}: not an import path; write it as 'package.module:function', e.g. "
            "'my_rewards.scoring:brevity'"
        )
    module_name, attr = path.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"reward {path!r}: cannot import module {module_name!r} ({exc}); install the package or add its "
            "folder to PYTHONPATH on every machine that runs the rollout stage"
        ) from exc
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"reward {path!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        # A ValueError, not TypeError: it is a config mistake the launcher must not retry.
        message = f"reward {path!r}: {attr!r} is a {type(fn).__name__}, not a function"
        raise ValueError(message)  # noqa: TRY004
    return RewardSpec(name=path, fn=fn, version=_user_version(fn))


def _user_version(fn: Callable) -> str:
    explicit = getattr(fn, "version", None)
    if explicit is not None:
        return str(explicit)
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
    try:
        # The whole module file, read now: a helper or a constant next to the function changes its scores as
        # much as its own lines, and a long-lived process (a flow planning many stages) must see an edit made
        # after the module was imported (inspect's line cache would not, for a same-size edit).
        source = Path(inspect.getsourcefile(inspect.getmodule(fn))).read_bytes()
    except (OSError, TypeError):
        try:
            source = inspect.getsource(fn).encode("utf-8")
        except (OSError, TypeError):
            # No source to hash (a builtin or C extension): its qualified name is the best identity there is.
            return f"name:{name}"
    return "src:" + hashlib.sha256(name.encode("utf-8") + b"\x00" + source).hexdigest()[:16]
