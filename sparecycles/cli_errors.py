"""One format for every refusal of the command line: `error: --option: why`, one line on stderr, exit status 2.

Click shows its own refusals (an option's conversion or bound, an unknown option, a missing argument, a
typer.BadParameter raised by a command's checks) as a four-line block (usage, "Try --help", a blank line, "Error:
Invalid value for ..."), while the commands' own checks print one line. `OneLineErrors`, the `sparecycles` group's
class, prints click's refusals the commands' way too. Torch-free.
"""

from __future__ import annotations

import re
from typing import Any

import typer
from typer.core import TyperGroup

try:  # typer vendors its own click (typer._click): its commands raise that one's exceptions
    from typer._click.exceptions import NoArgsIsHelpError, UsageError
except ImportError:  # an older typer on the real click
    from click.exceptions import NoArgsIsHelpError, UsageError


def one_line(exc: UsageError) -> str:
    """`exc`'s message as one line: click's "Invalid value for '--lr': why" as "--lr: why", "Invalid value: why"
    (a typer.BadParameter naming no option: the check's message names it) as "why", anything else as it is."""
    message = " ".join(exc.format_message().split()).replace("Value error, ", "")  # a validator's own message
    # click names an option's environment variables as a Python list repr: "(env var: '['A', 'B']')" -> "(env var: A
    # or B)"
    message = re.sub(r"\(env var: '\[(.*?)\]'\)",
                     lambda m: "(env var: " + " or ".join(v.strip(" '") for v in m.group(1).split(",")) + ")", message)
    message = re.sub(r"\(env var: '(\w+)'\)", r"(env var: \1)", message)  # one variable: unquoted too
    named = re.match(r"Invalid value for (.+?): (.*)$", message)
    if named:
        hint = named.group(1).replace("'", "").replace('"', "")
        why = named.group(2)
        return why if why.startswith(hint) else f"{hint}: {why}"
    return message.removeprefix("Invalid value: ")


class OneLineErrors(TyperGroup):
    """The `sparecycles` group: a subcommand's usage error (click's, or a typer.BadParameter from its checks) is
    printed as `error: <one_line>` and exits 2 (typer.Exit); a subgroup called without a command still shows its
    help."""

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except NoArgsIsHelpError:
            raise
        except UsageError as exc:
            typer.secho(f"error: {one_line(exc)}", fg=typer.colors.RED, err=True)
            raise typer.Exit(2) from exc
