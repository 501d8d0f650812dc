"""``%config`` in a cell (gpuhub/kernel/shell_settings.py): captured as plain data, taken on by
another process's shell, put back to the kernel's start when a later image no longer sets it.
Each case runs in processes of its own: an IPython shell is a process-wide singleton."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

_IN_A_SHELL = """
import json, sys
from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config
from gpuhub.kernel import shell_settings
# what the kernel starts with (its command line, ipython_config.py)
shell = InteractiveShell.instance(config=Config({"InteractiveShell": {"ast_node_interactivity": "last"}}))
shell_settings.take_baseline()
"""


def _in_a_shell(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", _IN_A_SHELL + code], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).parents[2])
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_config_magic_settings_are_taken_on_in_another_process():
    """``%config`` sets traits of the shell's objects and its config: a plain kernel keeps them in
    its process; another replica, or a GPU cell's fresh process, takes them on from the image."""
    state = json.loads(_in_a_shell("""
shell.run_line_magic("config", "InteractiveShell.ast_node_interactivity = 'all'")
shell.run_line_magic("config", "Completer.use_jedi = False")
shell.run_line_magic("config", "MagicsManager.auto_magic = False")
shell.run_line_magic("config", "InteractiveShell.separate_in = '  '")
print(json.dumps(shell_settings.capture()))
"""))
    assert state["config"] == {"Completer": {"use_jedi": False}, "MagicsManager": {"auto_magic": False},
                               "InteractiveShell": {"ast_node_interactivity": "all", "separate_in": "  "}}
    seen = _in_a_shell(f"""
state = json.loads({json.dumps(json.dumps(state))})
shell_settings.apply(state)
print(shell.ast_node_interactivity, shell.Completer.use_jedi, shell.magics_manager.auto_magic)
assert shell_settings.capture() == state, shell_settings.capture()
# a later image without the setting: the kernel's start again where it had one
shell_settings.apply({{"config": {{"Completer": {{"use_jedi": False}}}}}})
print(shell.ast_node_interactivity, shell.separate_in == '  ', shell.Completer.use_jedi)
""")
    assert seen.split("\n")[:2] == ["all False False", "last True False"]


def test_a_config_value_that_is_not_plain_data_stays_behind_and_the_rest_goes():
    out = _in_a_shell("""
import logging
logging.basicConfig()
shell.run_line_magic("config", "InteractiveShell.ast_node_interactivity = 'all'")
shell.config.PlainTextFormatter.type_printers = {int: repr}
state = shell_settings.capture()
print(state["config"])
""")
    assert out.splitlines()[0] == "{'InteractiveShell': {'ast_node_interactivity': 'all'}}"
