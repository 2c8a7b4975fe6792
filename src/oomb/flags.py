"""Command-line flags from the settings' declarations, and `--config` files read as the flags are.

TrainConfig's fields carry their help text and choices (oomb.train.config.setting); `add_settings`
turns any of them into argparse flags (type, least value, default, help, choices) for `oomb train`,
`plan` and `eval` alike, so a setting is declared once. transformers' HfArgumentParser reads the
same metadata but takes whole dataclasses (plan and eval take a few fields), filters `int | str`
(chunk_size 'auto') to int, and has no --no-X for an unset (None) bool: hence argparse, one helper.

`read_config` reads a YAML or JSON file of {setting: value}, each value checked by its flag's own
parser; main() makes them the flags' defaults, so the command line overrides the file.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import re
from pathlib import Path

from .units import parse_tokens


def attach_negative_values(argv: list[str]) -> list[str]:
    """`--flag -2,-1` as `--flag=-2,-1`: argparse takes a value that starts with '-' for an option
    unless it reads as one negative number, so a list of negative layer indices (the documented
    `--sparse-dense-layers -2,-1`) was refused as a missing argument. No flag starts with '-' and a
    digit, so such a token after a `--flag` is always its value."""
    out = []
    for token in argv:
        if out and re.match(r"-\d", token) and out[-1].startswith("--") and "=" not in out[-1]:
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def at_least(low: int):
    """An argparse type: a whole number >= low."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} must be >= {low}")
        return value
    return parse


def finite_number(low: float = 0.0, strict: bool = True, means: str = ""):
    """An argparse type: a finite number > low (strict) or >= low; `means` says what it is."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"{text!r} must be a finite number {'>' if strict else '>='} {low:g}"
                                             + (f": {means}" if means else ""))
        return value
    return parse


def or_auto(parse):
    """An argparse type: 'auto' (the run chooses), or what `parse` reads."""
    return lambda text: text if text == "auto" else parse(text)


def flag_of(f: dataclasses.Field) -> dict:
    """add_argument's keywords for a TrainConfig field: its type and least value (INT_FIELDS,
    FLOAT_FIELDS), default, help and choices (the field's metadata)."""
    from .train.config import FLOAT_FIELDS, INT_FIELDS

    kind = str(f.type)
    flag = {"default": f.default, "help": f.metadata["help"]}
    if kind in ("bool", "bool | None"):
        return {**flag, "action": argparse.BooleanOptionalAction}
    if f.name in INT_FIELDS:
        low = INT_FIELDS[f.name]
        parse = (lambda text: parse_tokens(text, low)) if f.metadata.get("tokens") else at_least(low)
        flag["type"] = or_auto(parse) if f.default == "auto" else parse
    elif f.name in FLOAT_FIELDS:
        flag["type"] = finite_number(*FLOAT_FIELDS[f.name])
    elif kind.startswith("float"):
        flag["type"] = float
    if "choices" in f.metadata:
        flag["choices"] = f.metadata["choices"]
    return flag


def add_settings(parser: argparse.ArgumentParser, names: tuple[str, ...] | None = None,
                 overrides: dict[str, dict] | None = None) -> None:
    """A --flag for each TrainConfig field in `names` (None: all of them), as declared;
    `overrides` {field: add_argument keywords} replaces what a command needs otherwise (its
    caller says why)."""
    from .train.config import TrainConfig

    declared = {f.name: f for f in dataclasses.fields(TrainConfig)}
    for name in names or declared:
        flag = {**flag_of(declared[name]), **(overrides or {}).get(name, {})}
        flag["help"] = flag["help"].replace("%", "%%")  # argparse formats help texts with %
        parser.add_argument("--" + name.replace("_", "-"), **flag)


def help_of(name: str) -> str:
    """The declared help text of the TrainConfig field `name`."""
    from .train.config import TrainConfig

    return next(f.metadata["help"] for f in dataclasses.fields(TrainConfig) if f.name == name)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's help ends with its default, unless it is unset (None, '': the help says what
    that means) or the help states it already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, "", argparse.SUPPRESS) or "(default" in text:
            return text
        return super()._get_help_string(action)


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="", metavar="FILE",
                        help="a .yaml or .json file of settings ({name: value}, the flags' names with underscores, "
                             "e.g. a run's config.yaml); flags given on the command line override it")


def read_config(path: str, parser: argparse.ArgumentParser) -> dict:
    """{dest: value} of the --config file `path` for `parser`'s flags, each value checked by its
    flag's parser and choices. A TrainConfig field the command has no flag for is skipped (a
    run's config.yaml plans what it trained); any other key, a wrong type or a bad value is a
    ValueError naming the file, the key and the value."""
    from .train.config import TrainConfig

    settings = _load(path)
    flags = {a.dest: a for a in parser._actions
             if a.option_strings and a.dest not in ("help", "config")}
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {}
    for key, value in settings.items():
        name = str(key).replace("-", "_")
        if name not in flags:
            if name in fields:
                continue
            near = difflib.get_close_matches(name, list(flags), n=1)
            raise ValueError(f"--config {path}: {key!r} is not a setting of {parser.prog}"
                             + (f"; did you mean {near[0]!r}?" if near else f" (see {parser.prog} --help)"))
        try:
            values[name] = _value(flags[name], value)
        except (argparse.ArgumentTypeError, ValueError) as e:
            raise ValueError(f"--config {path}: {key}: {value!r}: {e}") from None
    return values


def _load(path: str) -> dict:
    """The file's mapping: YAML (.yaml, .yml) or JSON (.json); nothing in it is run."""
    import yaml

    suffix = Path(path).suffix.lower()
    if suffix not in (".yaml", ".yml", ".json"):
        raise ValueError(f"--config {path}: a .yaml, .yml or .json file is read; rename it or convert it")
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"--config {path}: cannot read it ({e.strerror})") from None
    try:
        data = json.loads(text) if suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:
        raise ValueError(f"--config {path}: not valid {suffix[1:].upper()}: {' '.join(str(e).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: holds a {type(data).__name__}, not a mapping of settings "
                         "(name: value, one a line)")
    return data


def _value(action: argparse.Action, value):
    """`value` from a file as `action`'s flag would take it typed: a switch true or false (or
    null where unset is its default), a number or text through the flag's own parser."""
    if value is None:
        if action.default is None:
            return None
        raise ValueError("must be given (null is only for settings that are unset by default)")
    if action.nargs == 0:  # a switch: --x / --no-x
        if isinstance(value, bool):
            return value
        raise ValueError("must be true or false")
    if action.nargs == "+":
        return [_one(action, v) for v in (value if isinstance(value, list) else [value])]
    return _one(action, value)


def _one(action: argparse.Action, value):
    if action.type in (None, str):
        if not isinstance(value, str):
            raise ValueError("must be text (quote it in YAML: '...')")
        typed = value
    elif isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError("must be a number")
    else:
        typed = action.type(str(value))
    if action.choices is not None and typed not in action.choices:
        raise ValueError(f"must be one of {', '.join(map(str, action.choices))}")
    return typed
