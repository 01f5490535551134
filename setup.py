"""setuptools reads everything from pyproject.toml; this file only adds the `.pth` file to the wheel.

`mapping/npu_hub_kernels_llamafactory.pth` goes to the root of site-packages, where Python runs its one import
line at startup: that registers the `npu_hub` kernel plugin when LLaMA-Factory imports its kernel interface
(see mapping/_npu_hub_kernels_llamafactory.py). pyproject.toml cannot place a file at the root of site-packages.
Editable installs (`pip install -e`) do not get it.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "npu_hub_kernels_llamafactory.pth"
SOURCE = Path(__file__).parent / "mapping" / PTH


class BuildPyWithPth(build_py):
    """build_py, plus the .pth file at the root of the built tree (the root of site-packages once installed)."""

    def run(self) -> None:
        super().run()
        self.copy_file(str(SOURCE), str(Path(self.build_lib) / PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH)]


setup(cmdclass={"build_py": BuildPyWithPth})
