"""Package metadata: setuptools reads pyproject.toml without a warning (the license is an
SPDX expression, PEP 639), and the version the command line prints is the package's."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_pyproject_reads_without_warnings():
    import setuptools
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    text = (ROOT / "pyproject.toml").read_text()
    # The build requirement admits only setuptools versions that read the SPDX string.
    floor = re.search(r'requires = \["setuptools>=(\d+)', text)
    assert floor and int(floor[1]) >= 77
    assert int(setuptools.__version__.split(".")[0]) >= int(floor[1])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), ROOT / "pyproject.toml")
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if "license" in m.lower()], messages
    assert dist.metadata.license_expression == "Apache-2.0"


def test_version_is_one_number():
    import hybridserve

    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^version = "(.+)"$', text, re.M)[1] == hybridserve.__version__
