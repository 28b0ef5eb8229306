"""Argument-parser helpers of the commands that parse options of their own (`keel bench`, `keel gpu-check`, the
experiment commands): comma-separated lists, and errors in one line."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from keel.errors import ConfigError

KINDS = {int: "an integer", float: "a number"}  # what comma_list names a cast, in its error


def comma_list(cast: Callable[[str], Any]) -> Callable[[str], list]:
    """An argparse type for `--depths 8,16`: comma-separated values, never confused with trailing key=value
    overrides the way space-separated nargs='+' values would be. A bad value is named in the option's error
    (`argument --depths: 'x' in '8,x' is not an integer`), where argparse would say "invalid <lambda> value"."""

    def values(text: str) -> list:
        parsed = []
        for item in filter(None, (item.strip() for item in text.split(","))):
            try:
                parsed.append(cast(item))
            except ValueError:  # a cast's own argparse.ArgumentTypeError, its message, passes as it is
                kind = KINDS.get(cast, f"a valid {getattr(cast, '__name__', 'value')}")
                raise argparse.ArgumentTypeError(f"{item!r} in {text!r} is not {kind}") from None
        return parsed

    return values


class OneLineErrorParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors (a bad option value, an unknown option) are ConfigErrors, which `keel` prints
    as its one line with exit status 2, not as argparse's usage and message."""

    def error(self, message: str):
        if message.endswith("expected one argument"):  # `--members -1,abc`: argparse takes -1,abc for an option
            option = message.partition(":")[0].removeprefix("argument ").split("/")[-1]
            message += f" (a value that starts with '-' goes after '=': {option}=VALUE)"
        raise ConfigError(f"{message}; `{self.prog} --help` lists the options")
