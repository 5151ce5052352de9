"""Kernel families and dispatch.

A family is one way of computing one direction of attention on a kind of GPU: its module says which
problems it serves on which device (and why not), picks its tiles, plans and launches its kernels,
and lists the variants CI compiles and `flashcupy compile` / `check` cover. Dispatch takes the first
family in FAMILIES that serves the problem and does not pass it over (`passes_over`); `backend=`
(or the FLASHCUPY_BACKEND environment variable) forces one by name.

A new family is one module (a Family subclass) and one kernel source, added to `_family_classes`.
"""

from __future__ import annotations

import functools


class Family:
    """Base of the kernel families; subclasses set the class attributes and the methods."""

    name: str = ""       # what backend= names, e.g. "sm80"
    direction: str = ""  # "fwd" or "bwd"
    summary: str = ""    # one line for `flashcupy info`
    archs: tuple = ()    # NVRTC targets its variants are built for (`flashcupy compile --arch`, CI)

    def runs_on(self, capability: int) -> bool:
        """Whether any problem can run on a device of this compute capability (e.g. 90)."""
        raise NotImplementedError

    def unsupported(self, problem, device) -> str | None:
        """None when this family computes `problem` on `device` (a DeviceInfo), else the reason."""
        raise NotImplementedError

    def passes_over(self, problem, device) -> str | None:
        """None when the dispatcher takes this family for a problem it serves; else why it leaves it
        to the families after it (slower there, or not yet measured). backend= still runs it."""
        return None

    def variant(self, problem, device):
        """The kernel variant (tiles included) this family launches for `problem` on `device`."""
        raise NotImplementedError

    def variants(self, capability: int, smem_optin: int | None = None, **choice) -> list:
        """Every variant the family may launch on a device of this capability; `choice` narrows it
        (head_dims, dtypes, masks, score_mods, deterministic)."""
        raise NotImplementedError

    def ci_cases(self) -> list:
        """(variant, NVRTC arch) pairs that CI compiles on the CPU."""
        raise NotImplementedError

    def run(self, problem, device, *arrays):
        """Launch the kernels on CuPy's current stream. Forward: q, k, v, out, lse, returning what
        launches them again into other out and lse buffers: a callable of a buffers dict (a
        replay.Replay, or a replay.CallReplay where the launch allocates buffers of its own);
        backward: dout, q, k, v, out, lse, dq, dk, dv, returning D = rowsum(dO * O) and the call's
        launches with the buffers they allocate (replay.CallReplay)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{self.direction} family {self.name}>"


def _family_classes() -> list:
    from . import decode_fwd, sm80, sm90_bwd, sm90_fwd

    return [decode_fwd.DecodeForward, sm90_fwd.Sm90Forward, sm80.Sm80Forward, sm90_bwd.Sm90Backward,
            sm80.Sm80Backward]


@functools.lru_cache(maxsize=None)
def _instances() -> tuple:
    return tuple(cls() for cls in _family_classes())


def families(direction: str | None = None) -> tuple:
    """The families in dispatch order, of one direction ("fwd", "bwd") or all."""
    return _instances() if direction is None else tuple(f for f in _instances() if f.direction == direction)


def family_names(direction: str | None = None) -> list:
    return list(dict.fromkeys(f.name for f in families(direction)))


def select(direction: str, problem, device, backend: str | None = None, source: str = "backend=") -> Family:
    """The family that computes `problem`: the one named `backend` (an error if it does not serve the
    problem), else the first that serves it and does not pass it over (the last that serves it, if
    all do). `source` names where `backend` came from, for errors."""
    candidates = families(direction)
    if backend is not None:
        named = [f for f in candidates if f.name == backend]
        if not named:
            raise ValueError(f"{source} {backend!r} is not a {direction} kernel family; choose from "
                             f"{', '.join(family_names(direction))}")
        reason = named[0].unsupported(problem, device)
        if reason is not None:
            raise ValueError(f"{source} {backend!r} cannot compute this {direction}: {reason}")
        return named[0]
    reasons, serving = [], []
    for family in candidates:
        reason = family.unsupported(problem, device)
        if reason is None:
            if family.passes_over(problem, device) is None:
                return family
            serving.append(family)
        else:
            reasons.append(f"{family.name}: {reason}")
    if serving:
        return serving[-1]
    raise ValueError(f"no {direction} kernel family serves this problem on {device.name} ({'; '.join(reasons)})")
