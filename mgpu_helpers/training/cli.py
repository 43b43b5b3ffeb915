"""A script's command-line options from the fields of its settings dataclass, and back.

A training script runs what a notebook runs, with the same settings: the fields of one
dataclass (``recipe.DigitsRun`` for ``scripts/train_ddp.py``). Written out by hand the
options drift from the fields (a default copied once and then changed on one side
only); here each option is derived from its field, whose help text and allowed values
sit beside it as ``field(default=..., metadata={"help": ..., "choices": ...})``.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path

#: The types an option's field may have, alone or ``| None``. Not ``bool``: argparse
#: would call ``bool("False")``, which is True.
OPTION_TYPES = (int, float, str, Path)


def _option_type(cls: type, name: str, annotation) -> type:
    """The type argparse converts the option's text to: ``int`` for ``int | None``."""
    union = isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union
    kinds = [kind for kind in (typing.get_args(annotation) if union else (annotation,))
             if kind is not type(None)]
    if len(kinds) != 1 or kinds[0] not in OPTION_TYPES:
        raise TypeError(f"{cls.__name__}.{name} is {annotation}: an option's field must be "
                        "int, float, str or Path, or one of them | None")
    return kinds[0]


def add_options(parser: argparse.ArgumentParser, cls: type, names: Sequence[str],
                defaults: Mapping[str, object] | None = None) -> None:
    """Add an option per field named: ``--global-batch`` for the field ``global_batch``.

    Args:
        parser: gets the options, in the order of ``names``.
        cls: the settings dataclass. A field gives its option the type (``int`` for
            ``int | None``), the default, and through ``metadata`` the help text
            (``"help"``) and the allowed values (``"choices"``).
        names: the fields that are options; the others keep their defaults, settings a
            script has no reason to change (a notebook's progress bars, say).
        defaults: the script's own defaults where they differ from the dataclass's, by
            field name (a script that always checkpoints names a file the notebook
            does not).
    """
    fields = {field.name: field for field in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    defaults = defaults or {}
    for name in names:
        if name not in fields:
            raise ValueError(f"{cls.__name__} has no field {name!r}")
        field = fields[name]
        default = defaults.get(name, field.default)
        if default is dataclasses.MISSING:
            raise ValueError(f"{cls.__name__}.{name} has no default: give one in defaults")
        parser.add_argument("--" + name.replace("_", "-"),
                            type=_option_type(cls, name, hints[name]), default=default,
                            choices=field.metadata.get("choices"),
                            help=field.metadata.get("help"))


def from_options(parser: argparse.ArgumentParser, cls: type, args: argparse.Namespace,
                 names: Sequence[str]):
    """The dataclass built from the parsed options ``names`` (the others at defaults).

    A value the dataclass refuses (its ``__post_init__`` raises ``ValueError``) ends the
    program as argparse ends it for a malformed one, exit status 2 before anything
    starts, with the dataclass's message and its field names spelt as the options are
    (``global-batch must be ...``).
    """
    try:
        return cls(**{name: getattr(args, name) for name in names})
    except ValueError as exc:
        parser.error(str(exc).replace("_", "-"))
