"""What pyproject.toml cannot say: the wheel installs `lmq-lmql.pth` next to the packages.

LMQL 0.7.3 discovers no plugins (no entry points, no hook in `import lmql`), so `lmql.model("local:lmq:...")`
works without an import only if lmq's hook runs at start-up: `site` runs the .pth file's one line, which
installs an import hook that acts when LMQL's modules load (lmq_backend/lmql/hook.py). Everything else is in
pyproject.toml.
"""
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "lmq-lmql.pth"


class BuildPyWithPth(build_py):
    """build_py, plus the .pth file at the root of the wheel (or of an editable wheel)."""

    def run(self):
        super().run()
        # an editable install's wheel is assembled in install_lib; a regular wheel from build_lib
        target = self.get_finalized_command("install").install_lib if self.editable_mode else self.build_lib
        self.copy_file(str(Path(__file__).parent / PTH), str(Path(target) / PTH))

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH)]


setup(cmdclass={"build_py": BuildPyWithPth})
