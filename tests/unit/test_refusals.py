"""What gpuhub's kernels refuse, in this process: %pip's changes in an installed release."""

from __future__ import annotations

from gpuhub.kernel.refusals import say_why_pip_changes_nothing


class MagicsOnly:
    """The two methods of IPython's shell that the %pip wrapper uses."""

    def __init__(self, ran: list[str]) -> None:
        self.magics = {"pip": ran.append}

    def find_line_magic(self, name):
        return self.magics.get(name)

    def register_magic_function(self, func, kind, name) -> None:
        assert kind == "line"
        self.magics[name] = func


def test_pip_install_and_uninstall_say_why_and_run_nothing_the_rest_runs(capsys):
    ran: list[str] = []
    shell = MagicsOnly(ran)
    say_why_pip_changes_nothing(shell)
    for line in ("install tqdm", "uninstall -y numpy", "  install  -q x"):
        shell.magics["pip"](line)
        assert "changes nothing here" in capsys.readouterr().err
    assert ran == []
    shell.magics["pip"]("list")
    shell.magics["pip"]("show numpy")
    assert ran == ["list", "show numpy"]
    assert capsys.readouterr().err == ""
