"""The errors that carry a message for the user rather than a bug report: each says what is wrong and what to do,
and the command line prints it as one line (moe_lm/cli), without a traceback unless asked for."""

from __future__ import annotations

import reprlib

# why bounded: a value in a message can be a whole nested structure (a YAML file's, a user's list); the message
# must stay one readable line
_SHORT = reprlib.Repr()  # why attributes, not keywords: Python 3.11's Repr takes none
_SHORT.maxlevel, _SHORT.maxdict, _SHORT.maxlist, _SHORT.maxtuple, _SHORT.maxset = 3, 6, 6, 6, 6
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = 60, 60, 40


class ConfigError(ValueError):
    """A config file or override that cannot be accepted; the message names the dotted key."""


class DataError(ValueError):
    """Input data that cannot be read or used; the message names the file or source."""


class NotFound(DataError, FileNotFoundError):
    """A file, folder or checkpoint the user named is not there (a FileNotFoundError too, for callers catching one)."""


class MissingKey(DataError, KeyError):
    """A file lacks an entry it must hold, a tensor or a key (a KeyError too)."""


class RunError(RuntimeError):
    """A run that cannot start or go on; the message says why and what to do (no traceback needed)."""


class UserError(Exception):
    """Any other problem the user can fix (the message says how)."""


class MissingExtra(UserError):
    """An optional dependency a feature needs is not installed; the message names the extra that brings it."""


def shown(value) -> str:
    """`repr(value)` cut to a readable length (nested structures abbreviated with ...), for error messages."""
    return _SHORT.repr(value)


def install_hint(extra: str) -> str:
    """How to install one of moe-lm's extras (from the checkout: moe-lm is not on a package index)."""
    return f"pip install -e '.[{extra}]' in the moe-lm checkout"


def require(module: str, extra: str, purpose: str):
    """`import module`, or MissingExtra saying which extra brings it and how to install it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtra(f"{purpose} needs {module.split('.')[0]}: {install_hint(extra)}") from None


# why never, and no switch to allow it: a model or tokenizer folder travels like a run folder, and its auto_map would
# run its .py files; every architecture moe-lm analyses or imports is built into transformers, and a tokenizer can be
# given as its tokenizer.json
REMOTE_CODE_OFF = (
    "asks to run the folder's own Python code (auto_map), which moe-lm never does (trust_remote_code is off)"
)


def remote_code_refused(e: Exception) -> bool:
    """Whether transformers refused to load a folder (loaded with trust_remote_code=False) because of its own code."""
    return isinstance(e, ValueError) and "trust_remote_code" in str(e)
