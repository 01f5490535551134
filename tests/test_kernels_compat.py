"""Every private `kernels` name is imported in one place, mapping/npu_hub_kernels/_kernels_compat.py, which
refuses a kernels release outside the range it is used with, saying what to install."""

from __future__ import annotations

import re

import kernels
import pytest
from conftest import ROOT

from npu_hub_kernels import _kernels_compat as compat

PRIVATE_IMPORT = re.compile(
    r"^\s*(from kernels(\.\w+)*\._\w+ import|from kernels\._\w+|import kernels\.(\w+\.)*_\w+"
    r"|from kernels(\.\w+)* import (\([^)]*|[^\n#(]*)\b_(?!_)\w+)",
    re.MULTILINE,
)


def test_the_installed_kernels_is_in_the_supported_range():
    assert kernels.__version__ in compat.SUPPORTED and kernels.__version__ == compat.TESTED


@pytest.mark.parametrize("version", ["0.17.1", "0.18.1", "0.19.0"])
def test_a_kernels_release_outside_the_range_is_refused_with_what_to_install(version):
    with pytest.raises(ImportError, match=rf"kernels>=0\.17\.2,<0\.18\.1.*kernels {re.escape(version)} is installed"):
        compat.check_version(version)


@pytest.mark.parametrize("version", ["0.17.2", "0.18.0"])
def test_the_releases_transformers_accepts_pass_the_check(version):
    compat.check_version(version)


def test_no_other_file_imports_a_private_kernels_name():
    offenders = []
    for path in sorted([*ROOT.glob("mapping/**/*.py"), *ROOT.glob("scripts/**/*.py"), *ROOT.glob("tests/*.py")]):
        if path.name == "_kernels_compat.py":
            continue
        for match in PRIVATE_IMPORT.finditer(path.read_text()):
            offenders.append(f"{path.relative_to(ROOT)}: {match.group(0).strip()}")
    assert offenders == []


def test_the_pattern_catches_each_form_of_private_import():
    for line in (
        "from kernels._rust import Digest",
        "from kernels.layer.layer import _validate_layer",
        "import kernels._versions",
        "    from kernels.backends import CANN, _backend",
        "from kernels.load import (\n    get_kernel,\n    _parse_local_kernel_overrides,\n)",
    ):
        assert PRIVATE_IMPORT.search(line), line
    assert not PRIVATE_IMPORT.search("from kernels import Mode, kernelize")
    assert not PRIVATE_IMPORT.search("from kernels import __version__")
    assert not PRIVATE_IMPORT.search("from kernels import (\n    Mode,\n    kernelize,\n)")
