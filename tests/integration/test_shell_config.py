"""``%config`` and the options of IPython's objects set in a cell (gpuhub/kernel/shell_settings.py):
captured as plain data, taken on by another process's shell, put back to the kernel's start when a
later image no longer sets them. Each case runs in processes of its own: an IPython shell is a
process-wide singleton."""

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


def _taken_on(state: dict, code: str) -> str:
    """What ``code`` prints in a fresh shell that took ``state`` on."""
    return _in_a_shell(f"state = json.loads({json.dumps(json.dumps(state))})\nshell_settings.apply(state)\n" + code)


def test_config_magic_settings_are_taken_on_in_another_process():
    """``%config`` sets options of the shell's objects and its config: a plain kernel keeps them
    in its process; another replica, or a GPU cell's fresh process, takes them on from the image."""
    first, then = map(json.loads, _in_a_shell("""
shell.run_line_magic("config", "InteractiveShell.ast_node_interactivity = 'all'")
shell.run_line_magic("config", "Completer.use_jedi = False")
shell.run_line_magic("config", "MagicsManager.auto_magic = False")
shell.run_line_magic("config", "InlineBackend.figure_format = 'retina'")  # no such object yet
print(json.dumps(shell_settings.capture()))
shell.run_line_magic("config", "InteractiveShell.ast_node_interactivity = 'last'")  # the start's again
print(json.dumps(shell_settings.capture()))
""").splitlines())
    assert first["config"] == {"Completer": {"use_jedi": False}, "MagicsManager": {"auto_magic": False},
                               "InteractiveShell": {"ast_node_interactivity": "all"},
                               "InlineBackend": {"figure_format": "retina"}}
    seen = _taken_on(first, f"""
print(shell.ast_node_interactivity, shell.Completer.use_jedi, shell.magics_manager.auto_magic)
assert shell_settings.capture() == state, shell_settings.capture()
from matplotlib_inline.backend_inline import InlineBackend
print(InlineBackend.instance(parent=shell).figure_format)  # made after: it reads the shell's config
shell_settings.apply(json.loads({json.dumps(json.dumps(then))}))  # the next image
print(shell.ast_node_interactivity, shell.Completer.use_jedi, shell.magics_manager.auto_magic)
""")
    assert seen.splitlines() == ["all False False", "retina", "last False False"]


def test_options_a_cell_set_directly_are_taken_on_too():
    """The form found on many notebooks sets the class attribute, which hides the trait; setting
    an object's option is the other."""
    state = json.loads(_in_a_shell("""
InteractiveShell.ast_node_interactivity = "all"
shell.Completer.use_jedi = False
shell.history_manager.db_cache_size = 10**6  # what a GPU cell's process sets: never carried
print(json.dumps(shell_settings.capture()))
"""))
    options = state["options"]
    assert options["InteractiveShell"] == {"ast_node_interactivity": "all"}
    assert [v for k, v in options.items() if "Completer" in k] == [{"use_jedi": False}]
    assert "HistoryManager" not in options and "config" not in state
    seen = _taken_on(state, "print(shell.ast_node_interactivity, shell.Completer.use_jedi, "
                            "shell.history_manager.db_cache_size)")
    assert seen.split() == ["all", "False", "0"]


def test_options_this_replicas_own_cell_set_go_back_when_a_later_image_sets_them_back():
    """The executor never takes its own images: what its cell set, another replica's later cell
    may set back, and the image that says so lists nothing (the start's value is no change)."""
    seen = _in_a_shell("""
shell.ast_node_interactivity = "all"  # this replica's cell
shell.run_line_magic("config", "MagicsManager.auto_magic = False")
shell_settings.apply({})  # a later image from cells elsewhere that set both back
print(shell.ast_node_interactivity, shell.magics_manager.auto_magic)
""")
    assert seen.split() == ["last", "True"]


def test_a_direct_reset_after_config_decides():
    """``%config X.y = a`` then ``obj.y = <the start's value>``: the config still says ``a``; a
    replica taking the image must end at the start's value, as the executor has it."""
    state = json.loads(_in_a_shell("""
shell.run_line_magic("config", "InteractiveShell.ast_node_interactivity = 'all'")
shell.ast_node_interactivity = "last"
print(json.dumps(shell_settings.capture()))
"""))
    assert state["config"] == {"InteractiveShell": {"ast_node_interactivity": "all"}}
    assert _taken_on(state, "print(shell.ast_node_interactivity)").split() == ["last"]


def test_a_gpu_replica_takes_no_completion_option_that_evaluates_code():
    """IPython's greedy completion evaluates what is typed (``x.cuda().<Tab>`` calls ``x.cuda()``):
    in a GPU kernel's replica, which answers completions, that would start CUDA."""
    state = json.loads(_in_a_shell("""
shell.run_line_magic("config", "IPCompleter.greedy = True")
shell.run_line_magic("config", "Completer.use_jedi = False")
print(json.dumps(shell_settings.capture()))
"""))
    seen = _in_a_shell(f"""
shell_settings.defer_code()
shell_settings.apply(json.loads({json.dumps(json.dumps(state))}))
c = shell.Completer
print(c.greedy, c.evaluation, c.use_jedi, shell.config.IPCompleter.get("greedy"))
""")
    assert seen.split() == ["False", "limited", "False", "None"]
    assert _taken_on(state, "print(shell.Completer.greedy, shell.Completer.evaluation)").split() == ["True", "unsafe"]


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


def test_an_unchanged_shell_is_not_read_again_and_every_change_is_still_seen():
    """Every image reads the options of IPython's objects and the loggers' levels only when
    something may have changed (gpuhub/kernel/shell_settings.py: _OptionsWatch, _logger_levels)."""
    out = _in_a_shell("""
import logging
options = lambda: (shell_settings.capture().get("options") or {}).get("InteractiveShell", {})
levels = lambda: shell_settings.capture().get("logging", {}).get("levels")
assert options() == {} and levels() is None
first = shell_settings._options_read
assert options() == {} and shell_settings._options_read is first  # not read again
shell.autoindent = not shell.autoindent  # a set: traitlets tells its observers
print(sorted(options()))
InteractiveShell.ast_node_interactivity = "all"  # a class attribute hiding the trait: no observer
print(options()["ast_node_interactivity"])
InteractiveShell.ast_node_interactivity = "none"
print(options()["ast_node_interactivity"])
shell.ast_node_interactivity = "last"  # with the trait hidden, a set lands in the object's __dict__ unreported
print(options().get("ast_node_interactivity"))
logging.getLogger("gh.lib").setLevel(logging.ERROR)
print(levels())
logging.getLogger("gh.lib").setLevel(logging.INFO)
print(levels())
""")
    assert out.splitlines() == ["['autoindent']", "all", "none", "None", "[['gh.lib', 40]]", "[['gh.lib', 20]]"]
