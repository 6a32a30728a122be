"""The server distribution, ``dsec``: everything but what the SDK distribution
(``dsec-sdk``, built from sdk/) carries, which it depends on instead of repeating.

Both install into the one ``app`` package: the SDK brings ``app/__init__.py``, the
plumbing it shares (config, errors, the bus), the wire protocol's domain modules and
``app/sdk``; this wheel brings the rest, the node (``workers``), and the files the
platform reads at run time (migrations, the agent's C source, the broker's Maven
project, the sandbox image's Containerfile).
"""

from __future__ import annotations

import re
import shutil
import tomllib
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent

#: What the SDK distribution owns (sdk/app mirrors it with links; a unit test checks
#: the two agree and that everything ``app.sdk`` imports is in it).
SDK_OWNS = (
    "app/__init__.py",
    "app/bus.py",
    "app/config.py",
    "app/credentials.py",
    "app/egress_config.py",
    "app/errors.py",
    "app/image_config.py",
    "app/rdkafka_config.py",
    "app/domain/__init__.py",
    "app/domain/base.py",
    "app/domain/codec.py",
    "app/domain/egress.py",
    "app/domain/events.py",
    "app/domain/hub_access.py",
    "app/domain/proof.py",
    "app/domain/records.py",
    "app/domain/replies.py",
    "app/domain/requests.py",
    "app/sdk",
)


def version() -> str:
    """``app.__version__``, read without importing the package."""
    text = (HERE / "app" / "__init__.py").read_text()
    found = re.search(r'^__version__ = "([^"]+)"', text, re.MULTILINE)
    assert found, "app/__init__.py names no __version__"
    return found.group(1)


def sdk_owned(path: str) -> bool:
    return any(path == owned or path.startswith(owned + "/") for owned in SDK_OWNS)


class BuildPy(build_py):
    """Leaves the SDK's modules out of the wheel and adds the migrations under
    app/db/migrations (a checkout keeps them at the top, where Alembic's command line
    expects them)."""

    #: True while the sdist asks for the sources: it keeps the SDK's files, since the
    #: wheel is built from it and needs ``app/__init__.py`` (the version) and the
    #: packages' ``__init__`` files (to find ``app`` and ``app.domain`` at all).
    listing_sources = False

    def get_source_files(self) -> list[str]:
        self.listing_sources = True
        try:
            return super().get_source_files()
        finally:
            self.listing_sources = False

    def find_package_modules(self, package: str, package_dir: str) -> list[tuple[str, str, str]]:
        found = super().find_package_modules(package, package_dir)
        if self.listing_sources:
            return found
        return [m for m in found if not sdk_owned(Path(m[2]).as_posix())]

    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / "app" / "db" / "migrations"
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(
            HERE / "migrations", target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
        )


if __name__ == "__main__":
    server = tomllib.loads((HERE / "pyproject.toml").read_text())["tool"]["dsec"]
    setup(
        version=version(),
        # "dsec-sdk" is pinned to this very version: the two are released together.
        install_requires=[
            f"dsec-sdk=={version()}" if dep == "dsec-sdk" else dep for dep in server["dependencies"]
        ],
        packages=find_packages(include=["app*", "workers*"], exclude=["app.sdk", "app.sdk.*"]),
        package_data={
            "workers.agent": ["*.c"],
            "app.images": ["*.Containerfile"],
            # The embedded broker's Maven project, pinned checksums, logging settings.
            "app.stack": ["kafka/*"],
        },
        # Only the package data named above: the SDK's files, also under app/, are not.
        include_package_data=False,
        cmdclass={"build_py": BuildPy},
    )
