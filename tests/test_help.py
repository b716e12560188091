"""``python -m hpctrain --help`` names every command the parser has and every exit code hpctrain uses.

The help's description is hpctrain/__main__.py's module docstring, written by hand; these tests keep
it in step with the code: the commands are walked from ``_parser()``'s subparsers, the exit codes read
from the ``EXIT_*`` names of :mod:`hpctrain.errors`. Only the description is checked, not the list
argparse prints after it, which names every top-level command whatever the docstring says.
"""

import argparse
import re
import subprocess
import sys

import pytest

import hpctrain.errors
from conftest import REPO
from hpctrain.__main__ import _parser

pytestmark = pytest.mark.timeout(60)


def _commands(parser, prefix=()):
    """Every command path the parser defines, nested ones too: ("train",), ("data", "synth"), ..."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield prefix + (name,)
                yield from _commands(sub, prefix + (name,))


@pytest.fixture(scope="module")
def description():
    """The help text argparse prints between the usage line and its own list of the subcommands."""
    proc = subprocess.run([sys.executable, "-m", "hpctrain", "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    head, found, _ = proc.stdout.partition("\npositional arguments:")
    assert found, proc.stdout
    return head


def test_every_command_is_listed(description):
    commands = list(_commands(_parser()))
    assert len([c for c in commands if len(c) == 1]) >= 8, commands  # the walk found the parser's commands
    block = description.partition("\nCommands\n")[2].partition("\nExit codes:")[0]
    assert block, description
    for path in commands:
        if len(path) == 1:  # a top-level command: a line of its own, "  name  what it does"
            assert re.search(rf"^  {re.escape(path[0])}\s", block, re.M), f"{path[0]} missing from:\n{block}"
        else:  # an action of a command: named with its command, e.g. ``data synth``
            assert " ".join(path) in block, f"{' '.join(path)} missing from:\n{block}"


def test_every_exit_code_is_explained(description):
    codes = {name: value for name, value in vars(hpctrain.errors).items() if name.startswith("EXIT_")}
    assert codes, "hpctrain.errors defines no EXIT_* codes"
    paragraph = description.partition("\nExit codes:")[2]
    # "0 ok; 2 a user error (...); 3 ...; ...; 1 anything else (...)": each entry starts with its code
    explained = {int(m.group(1)) for entry in paragraph.split(";") if (m := re.match(r"\s*(\d+)\s", entry))}
    for name, value in sorted(codes.items(), key=lambda item: item[1]):
        assert value in explained, f"{name} = {value} is not explained in:\n{paragraph}"
    assert {0, 1} <= explained, paragraph  # success, and the abort every other failure ends in
