"""Settings read from the environment under the names the docs give."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.config import Settings


@pytest.mark.parametrize("name", ["DSEC_CREDENTIALS", "DSEC_CREDENTIALS_FILE"])
def test_a_trainer_names_its_credential_file_as_the_readme_says(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(name, "/etc/dsec/team-b.json")
    assert Settings().credentials_file == Path("/etc/dsec/team-b.json")
