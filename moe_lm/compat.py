"""What moe-lm still reads of what older releases wrote, and until when: each shim ends at a release, from which the
old form is an error saying what to do (as renamed config keys do, moe_lm/config/moved_keys.py).

    what is still read                                       read until  then
    run folders without a marker (recognised entry by entry)  0.3         train on it once with 0.2 (adds the marker)
    COMPLETE files with sizes but no hashes                   0.3         resume once with 0.2 (saves again)
    RNG files holding numpy arrays (not tensors)              0.3         resume once with 0.2 (saves tensors)
    data folders without meta.json's token hashes or bos_id   0.3         moe-lm prepare --force
    routing traces of format 1 or 2 (columns not named)       0.3         record the trace again (moe-lm analyze)
"""

from __future__ import annotations

from moe_lm.errors import DataError

SHIMS_UNTIL = (0, 3)  # the release from which none of the old forms above is read


def release() -> tuple[int, int]:
    """This installation's moe-lm release (major, minor), from the package's metadata."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = version("moe-lm").split(".")[:2]
        return int(major), int(minor)
    except (PackageNotFoundError, ValueError):
        return (0, 0)  # a source tree that was never installed: the old forms still load


def old_form(what: str, fix: str) -> None:
    """Reading `what` (a form older releases wrote) is allowed before SHIMS_UNTIL; from then it is a DataError
    saying `fix`."""
    if release() >= SHIMS_UNTIL:
        until = ".".join(map(str, SHIMS_UNTIL))
        raise DataError(f"{what} was written by an older moe-lm, which moe-lm {until} no longer reads: {fix}")
