"""What a value of ``CUDA_VISIBLE_DEVICES`` means, read the way CUDA reads it.

CUDA reads the variable once, when the driver initialises in a process, and it is
forgiving in surprising ways: it stops at the first entry it cannot read, takes the
leading digits of an entry (``"1gpu"`` is GPU 1), and hides every GPU when an entry is
repeated. This module turns a raw value into the list of devices a process will see and
a sentence saying why, so that a typo is explained instead of silently hiding GPUs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

ENV_VAR = "CUDA_VISIBLE_DEVICES"
_UUID_PREFIXES = ("GPU-", "MIG-")


@dataclass(frozen=True)
class VisibleDevices:
    """The parsed value of ``CUDA_VISIBLE_DEVICES``.

    Args:
        raw: the value as set, or ``None`` when the variable is unset.
        entries: the devices CUDA will expose, in order (indices or UUID strings);
            ``None`` means "every GPU" (variable unset).
        meaning: one sentence a person can read.
        problem: what looks like a mistake in the value, or ``None``.
    """

    raw: str | None
    entries: tuple[int | str, ...] | None
    meaning: str
    problem: str | None = None

    @property
    def hides_all(self) -> bool:
        return self.entries == ()

    def visible_count(self, physical: int) -> int:
        """How many GPUs a process sees on a machine with ``physical`` GPUs.

        CUDA stops at the first index that does not exist on the machine, so
        ``"0,5,1"`` on a 2-GPU machine exposes one device.
        """
        if physical < 0:
            raise ValueError(f"physical GPU count must be >= 0, got {physical}")
        if self.entries is None:
            return physical
        count = 0
        for entry in self.entries:
            if isinstance(entry, int) and entry >= physical:
                break
            count += 1
        return min(count, physical)


def _leading_int(text: str) -> int | None:
    """The integer a C ``strtol`` reads at the start of ``text``, or None if none."""
    sign_end = 1 if text[:1] in ("+", "-") else 0
    end = sign_end
    while end < len(text) and text[end].isdigit():
        end += 1
    if end == sign_end:
        return None
    return int(text[:end])


def _join_devices(indices: list[int | str]) -> str:
    names = [str(i) for i in indices]
    devices = "GPU " + names[0] if len(names) == 1 else "GPUs " + ", ".join(names)
    aliases = ", ".join(f"cuda:{k}" for k in range(len(names)))
    return f"{devices} visible, as {aliases}"


def _parse_uuids(raw: str, items: list[str]) -> VisibleDevices:
    prefix = next(p for p in _UUID_PREFIXES if items[0].strip().startswith(p))
    chosen: list[int | str] = []
    for position, item in enumerate(items, start=1):
        text = item.strip()
        if text in chosen:
            return VisibleDevices(
                raw, (), f"no GPU is visible: {text!r} is listed twice, and CUDA rejects a "
                "list with a repeated device", problem=f"repeated device {text!r}")
        if not text.startswith(prefix):
            rest = ",".join(items[position - 1:])
            return VisibleDevices(
                raw, tuple(chosen),
                f"{_join_devices(chosen)}; entry {position} ({text!r}) is not a {prefix} UUID, "
                f"so CUDA stops reading there and ignores {rest!r}",
                problem=f"entry {position} is not a {prefix} UUID")
        chosen.append(text)
    return VisibleDevices(raw, tuple(chosen), _join_devices(chosen))


def parse_cuda_visible_devices(raw: str | None = None, *, from_env: bool = False) -> VisibleDevices:
    """Read a ``CUDA_VISIBLE_DEVICES`` value the way the CUDA runtime does.

    Args:
        raw: the value to read; ``None`` means "unset".
        from_env: read the current process's environment instead of ``raw``.

    Returns:
        A :class:`VisibleDevices` with the devices and a plain-language meaning.
    """
    if from_env:
        raw = os.environ.get(ENV_VAR)
    if raw is None:
        return VisibleDevices(None, None, "every GPU is visible")
    if raw.strip() == "":
        return VisibleDevices(raw, (), "set but empty: no GPU is visible")
    items = raw.split(",")
    if items[0].strip().startswith(_UUID_PREFIXES):
        return _parse_uuids(raw, items)

    chosen: list[int] = []
    notes: list[str] = []
    for position, item in enumerate(items, start=1):
        text = item.strip()
        number = _leading_int(text)
        if number is not None and number >= 0 and number in chosen:
            return VisibleDevices(
                raw, (), f"no GPU is visible: GPU {number} is listed twice, and CUDA rejects "
                "a list with a repeated device", problem=f"GPU {number} is repeated")
        if number is None or number < 0:
            if text == "":
                why = f"entry {position} is empty"
            elif number is None:
                why = f"entry {position} ({text!r}) is not a device index or UUID"
            else:
                why = f"entry {position} ({text!r}) is negative"
            rest = ",".join(items[position:])
            if not chosen:
                hide_all_idiom = raw.strip() == "-1"
                hint = "; '-1' is the usual way to hide every GPU" if hide_all_idiom else ""
                return VisibleDevices(
                    raw, (), f"no GPU is visible: {why}, and CUDA stops reading at the first "
                    f"entry it cannot use{hint}",
                    problem=None if hide_all_idiom else why)
            ignored = f", so {rest!r} is ignored" if rest else ""
            return VisibleDevices(
                raw, tuple(chosen),
                f"{_join_devices(chosen)}; {why} and CUDA stops reading there{ignored}",
                problem=why)
        if text != str(number):
            notes.append(f"entry {position} ({text!r}) is read as {number}")
        chosen.append(number)
    meaning = _join_devices(chosen)
    problem = "; ".join(notes) or None
    if problem:
        meaning += f" ({problem}: CUDA reads only the leading digits)"
    return VisibleDevices(raw, tuple(chosen), meaning, problem=problem)
