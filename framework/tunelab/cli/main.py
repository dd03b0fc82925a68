"""The ``tunelab`` command: ``ls``, ``cp``, ``validate``, ``run``, ``eval``, ``verify``, ``export``, ``download``, ``data``."""

from __future__ import annotations

import argparse
import sys
import traceback

from tunelab.cli import _cp, _data, _download, _eval, _export, _ls, _run, _validate, _verify
from tunelab.errors import TunelabError, shorten
from tunelab.lifecycle.entry import debug_enabled

_COMMANDS = {
    "ls": _ls,
    "cp": _cp,
    "validate": _validate,
    "verify": _verify,
    "export": _export,
    "download": _download,
    "data": _data,
}


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of the ``tunelab`` command."""
    # --debug is accepted before and after the subcommand; SUPPRESS keeps a subcommand's
    # default from overwriting a --debug given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS,
        help="show tracebacks (also TUNELAB_DEBUG=1)",
    )
    parser = argparse.ArgumentParser(
        prog="tunelab",
        description="PyTorch-native fine-tuning of decoder LLMs: YAML recipes on FSDP2.",
        parents=[common],
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in ("ls", "cp", "run", "eval", "validate", "verify", "export", "download", "data"):
        module = {"run": _run, "eval": _eval}.get(name) or _COMMANDS[name]
        module.add_parser(subparsers, common)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``tunelab`` command and exit with its code.

    A ``TunelabError`` prints ``tunelab: error: <message>`` (each line at most about 200
    characters, long paths elided in the middle: ``errors.shorten``) and exits 1 (argparse usage
    errors exit 2); ``--debug`` or ``TUNELAB_DEBUG=1`` shows the traceback as well.

    Args:
        argv: The arguments (``sys.argv[1:]`` when None).

    Returns:
        The exit code (also passed to ``sys.exit`` when run as the console script).
    """
    argv = sys.argv[1:] if argv is None else argv
    debug = debug_enabled(argv)
    parser = build_parser()
    try:
        command = next((arg for arg in argv if arg != "--debug"), None)
        if command == "run":
            code = _run.run_command(argv[argv.index("run") + 1 :], debug)
        elif command == "eval":
            # The short form of `tunelab run [TORCHRUN OPTIONS] eval --config ...`.
            rest = argv[argv.index("eval") + 1 :]
            run_argv = _eval.as_run_arguments(rest)
            if run_argv is None:  # -h, --help, or nothing (a usage error, as for `run`)
                print(_eval.USAGE, end="")
                code = 0 if rest else 2
            else:
                code = _run.run_command(run_argv, debug)
        else:
            namespace = parser.parse_args(argv)
            if namespace.command is None:
                parser.print_help(sys.stderr)
                code = 2
            else:
                code = _COMMANDS[namespace.command].run(namespace)
    except TunelabError as err:
        if debug:
            traceback.print_exc()
        print(f"tunelab: error: {shorten(str(err))}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)
