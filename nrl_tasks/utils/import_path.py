"""Finding a user's plug-in by its import path (``package.module:attr.path``): the reward
function (``env.reward_fn``) and the environment class (``env.environment``).

A user's module runs arbitrary code at import: it may call ``sys.exit`` or ``os._exit``, raise
anything (``SyntaxError``, ``KeyboardInterrupt``) or never return. Preflight therefore imports it
with ``isolate=True``: first once in a short-lived child process under a time limit
(``NRL_PLUGIN_IMPORT_TIMEOUT_S``), where an exit, a hang (the child's process group is killed) or
an exception cannot touch the caller, then in this process; every way an import can fail is a
``ValueError`` naming the plug-in (the CLI's config error, exit 2). The project's own modules, the
standard library and modules already imported need no child.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
from typing import Any

__all__ = ["check_import_in_child", "import_attribute"]

#: the project's packages: their modules need no child process
_OWN_PACKAGES = frozenset({"nrl_tasks", "flows", "storage"})
#: the child's last stdout line when the import returned
_OK = "nrl-import-ok"
#: the child: import argv[1] with the caller's sys.path (argv[2]), report on stdout's last line,
#: and leave at once (no atexit handlers or threads the module started)
_CHILD = f"""
import importlib, json, os, sys
sys.path[:] = json.loads(sys.argv[2])
try:
    importlib.import_module(sys.argv[1])
except BaseException as exc:
    print("\\n" + json.dumps([type(exc).__name__, str(exc), isinstance(exc, ImportError)]), flush=True)
    os._exit(3)
print("\\n{_OK}", flush=True)
os._exit(0)
"""


def _needs_child(module_name: str) -> bool:
    """Whether importing ``module_name`` may run a user's code not run yet in this process."""
    top = module_name.partition(".")[0]
    return module_name not in sys.modules and top not in _OWN_PACKAGES and top not in sys.stdlib_module_names


def _child_outcome(module_name: str, returncode: int, stdout: str) -> str | None:
    """What went wrong when the child imported ``module_name`` (``None``: the import returned).

    >>> _child_outcome("m", 0, "x\\nnrl-import-ok\\n") is None, _child_outcome("m", 0, "")
    (True, "module 'm' exited at import with status 0 (sys.exit or os._exit)")
    >>> _child_outcome("m", 3, '\\n["SyntaxError", "bad", false]\\n'), _child_outcome("m", -9, "")
    ("module 'm' raised SyntaxError: bad", "module 'm' was killed at import by SIGKILL")
    >>> _child_outcome("m", 3, '["ModuleNotFoundError", "No module named m", true]')
    "cannot import module 'm': No module named m"
    """
    lines = stdout.strip().splitlines()
    last = lines[-1] if lines else ""
    if returncode == 0 and last == _OK:
        return None
    if returncode == 3 and last.startswith("["):
        try:
            name, message, import_error = json.loads(last)
        except ValueError:
            pass
        else:
            if import_error:  # the same words as an import in this process
                return f"cannot import module {module_name!r}: {message}"
            return f"module {module_name!r} raised {name}: {message}"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"module {module_name!r} was killed at import by {name}"
    return f"module {module_name!r} exited at import with status {returncode} (sys.exit or os._exit)"


def check_import_in_child(module_name: str, label: str, timeout_s: float | None = None) -> None:
    """Import ``module_name`` once in a child process (this interpreter, this ``sys.path``);
    ``ValueError`` starting with ``label`` when it exits, is killed, raises or takes longer than
    ``timeout_s`` (default ``NRL_PLUGIN_IMPORT_TIMEOUT_S``; the child and what it started are then
    killed)."""
    if timeout_s is None:
        from nrl_tasks.settings import nrl_settings

        timeout_s = nrl_settings().plugin_import_timeout_s
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, module_name, json.dumps(sys.path)],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
    )
    try:
        stdout, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise ValueError(
            f"{label}: importing module {module_name!r} did not finish within {timeout_s:g} s "
            "(NRL_PLUGIN_IMPORT_TIMEOUT_S): does it wait for something at import?"
        ) from None
    problem = _child_outcome(module_name, proc.returncode, stdout)
    if problem is not None:
        raise ValueError(f"{label}: {problem}")


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the child's process group (the child was started in a session of its own) and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.communicate()


def import_attribute(module_name: str, attr_path: str, label: str, *, isolate: bool = False) -> Any:
    """``module_name``'s attribute ``attr_path`` (dotted); ``ValueError`` starting with ``label``
    (e.g. ``"reward_fn 'pkg.mod:fn'"``) when the module cannot be imported (whatever it raises,
    ``SystemExit`` and ``KeyboardInterrupt`` included) or lacks the attribute. ``isolate``: a
    user's module not imported yet is first imported in a child process
    (:func:`check_import_in_child`), so an exit or a hang at import is a ``ValueError`` too.

    >>> import_attribute("os.path", "join", "x").__name__
    'join'
    """
    if isolate and _needs_child(module_name):
        check_import_in_child(module_name, label)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{label}: cannot import module {module_name!r}: {exc}") from exc
    except BaseException as exc:  # noqa: BLE001 - a plug-in's import may raise anything, exits included
        raise ValueError(f"{label}: module {module_name!r} raised {type(exc).__name__}: {exc}") from exc
    obj: Any = module
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{label}: module {module_name!r} has no attribute {attr_path!r}") from None
    return obj
