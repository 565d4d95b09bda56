"""The README stays true to the code: its set-up commands, its scenario reference, CI."""

import dataclasses
import re
from pathlib import Path

from sim.scenario import SECTIONS

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_exactly_two_setup_commands_and_ci_runs_the_test_one():
    setup = README.split("## Set up", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```sh\n(.*?)\n```", setup, re.S)
    assert len(blocks) == 2
    assert "servesim" in blocks[0] and "pytest" in blocks[1]
    assert blocks[1] in (ROOT / ".ci" / "run").read_text()


def test_every_scenario_field_is_documented():
    for name, cls in SECTIONS.items():
        section = README.split(f"\n`[{name}]`\n", 1)[1].split("\n\n`[", 1)[0]
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in section, (name, f.name)


def test_every_bundled_scenario_is_listed():
    for p in (ROOT / "scenarios").glob("*.toml"):
        assert f"`{p.stem}`" in README, p.stem
