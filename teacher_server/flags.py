"""Command-line flags from dataclasses: one field, one flag, its docstring the help text.

The server's settings (:class:`teacher_server.config.ServerConfig`) and each backend's
(its ``Flags`` class) are dataclasses whose fields carry a docstring, as vLLM's engine
arguments do (``EngineArgs.add_cli_args``). :func:`add_flags` turns them into
``argparse`` flags (``--field-name``, the field's type and default, the docstring as help)
and :func:`from_args` reads the parsed values back into the dataclass, so a setting is
declared, documented and defaulted in one place.

Written here rather than taken from vLLM (``vllm.config.utils.get_attr_docs``) because
the transformers and replay backends run without vLLM installed, and a general library
for this (``tyro``, ``simple-parsing``) would be a new server dependency for about sixty
lines; vLLM's own parser is still used for its engine flags.

A field's ``metadata`` may set ``type`` (a converter raising ``argparse.ArgumentTypeError``
or ``ValueError``), ``choices``, ``metavar``, or ``flag=False`` (not a flag). A
``tuple[X, ...]`` field is a repeatable flag (each use adds one value).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import sys
import textwrap
import types
import typing
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

from topk_protocol import check_temperature

__all__ = [
    "DefaultsHelpFormatter",
    "add_flags",
    "field_docs",
    "flag_fields",
    "from_args",
    "temperature_arg",
]

D = TypeVar("D")


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each flag's default, once: not where the help text already says
    its default (``(default: --host)``), nor ``(default: None)`` (no default to show)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text.lower() or action.default is None:
            return text
        return super()._get_help_string(action)


def temperature_arg(value: str) -> float:
    """``--teacher-temperature``'s converter: a finite number > 0, or a parse error."""
    try:
        return check_temperature(value, "teacher_temperature")
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


@cache
def field_docs(cls: type) -> dict[str, str]:
    """``field name -> docstring`` of a dataclass: the string literal right below each
    annotated field in the class body (its bases' first)."""
    docs: dict[str, str] = {}
    for base in reversed(cls.__mro__[1:]):
        if dataclasses.is_dataclass(base):
            docs.update(field_docs(base))
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    for stmt, nxt in itertools.pairwise(body):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def flag_fields(cls: type) -> list[dataclasses.Field[Any]]:
    """The fields of dataclass ``cls`` that are command-line flags."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("flag", True)]


def _flag_hints(cls: type) -> dict[str, Any]:
    """The resolved annotation of each flag field, evaluated in the module of the class
    that declares it (``typing.get_type_hints`` would also evaluate the non-flag fields,
    whose types may be imported for type checking only)."""
    flags = {f.name for f in flag_fields(cls)}
    hints: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        namespace = vars(sys.modules[klass.__module__])
        for name, annotation in vars(klass).get("__annotations__", {}).items():
            if name in flags:
                hints[name] = (
                    eval(annotation, namespace)  # the class's own annotation, in its module
                    if isinstance(annotation, str)
                    else annotation
                )
    return hints


def _base_type(annotation: Any) -> tuple[Any, bool]:
    """``X | None`` -> ``(X, True)``; ``X`` -> ``(X, False)``."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return inner, True
    return annotation, False


def add_flags(
    parser: argparse.ArgumentParser | Any, cls: type, title: str = "", *, hidden: bool = False
) -> None:
    """Add one flag per field of dataclass ``cls`` to ``parser`` (in a group titled
    ``title`` when given). A field without a default is a required flag; a ``bool``
    field defaulting to True becomes ``--no-<name>``, one defaulting to False ``--<name>``.
    ``hidden``: the flags parse but ``--help`` does not list them."""
    target = parser.add_argument_group(title) if title else parser
    hints = _flag_hints(cls)
    docs = field_docs(cls)
    for f in flag_fields(cls):
        name = f.name.replace("_", "-")
        helptext = argparse.SUPPRESS if hidden else docs.get(f.name, "")
        typ, _ = _base_type(hints[f.name])
        has_default = f.default is not dataclasses.MISSING
        if typ is bool:
            if not has_default:
                raise TypeError(f"{cls.__name__}.{f.name}: a bool flag needs a default")
            flag = f"--no-{name}" if f.default else f"--{name}"
            action = "store_false" if f.default else "store_true"
            # No default in the namespace (nor "(default: True)" in the help of a flag that
            # turns it off): from_args takes the field's default when the flag is absent.
            target.add_argument(
                flag, dest=f.name, action=action, help=helptext, default=argparse.SUPPRESS
            )
            continue
        kwargs: dict[str, Any] = {"dest": f.name, "help": helptext}
        if typing.get_origin(typ) is tuple:  # repeatable: absent -> the field's default
            (item, _) = typing.get_args(typ)
            kwargs.update(action="append", default=argparse.SUPPRESS)
            kwargs["type"] = f.metadata.get("type", item)
            if "metavar" in f.metadata:
                kwargs["metavar"] = f.metadata["metavar"]
            target.add_argument(f"--{name}", **kwargs)
            continue
        kwargs["type"] = f.metadata.get("type", Path if typ is Path else typ)
        for key in ("choices", "metavar"):
            if key in f.metadata:
                kwargs[key] = f.metadata[key]
        if has_default:
            kwargs["default"] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            kwargs["default"] = f.default_factory()
        else:
            kwargs["required"] = True
        target.add_argument(f"--{name}", **kwargs)


def from_args(cls: type[D], args: argparse.Namespace, **values: Any) -> D:
    """The dataclass ``cls`` with each flag field read from ``args``; ``values`` fill
    (or override) fields by name."""
    read = {f.name: getattr(args, f.name) for f in flag_fields(cls) if hasattr(args, f.name)}
    return cls(**{**read, **values})
