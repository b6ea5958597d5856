"""Each ``LynxConfig`` field is described once, in the class docstring: ``lynx-hf``'s option help is the first sentence
of that entry and ``docs/policies.md``'s table is the whole entry (``lynx_hf.config.field_docs`` / ``field_help`` /
``fields_markdown``)."""

import argparse
import re
from dataclasses import fields
from pathlib import Path

from lynx_hf import cli, config
from lynx_hf.config import LynxConfig

ROOT = Path(__file__).resolve().parents[2]


def test_every_field_has_one_entry_and_no_second_description():
    names = [f.name for f in fields(LynxConfig)]
    entries = re.findall(r"^    - ``(\w+)``: ", LynxConfig.__doc__, re.MULTILINE)
    assert sorted(entries) == sorted(names) and len(entries) == len(set(entries))
    assert all(not f.metadata for f in fields(LynxConfig))  # no help text beside the docstring
    assert all(config.field_docs()[name] for name in names)


def test_cli_help_is_the_first_sentence_of_the_entry():
    parser = argparse.ArgumentParser()
    cli._policy_args(parser)  # the --<field> options of lynx-hf generate
    helps = {a.dest: a.help for a in parser._actions}
    for f in fields(LynxConfig):
        first = config.field_help(f.name)
        assert helps[f.name].replace("%%", "%").startswith(first), (f.name, helps[f.name])
        assert first.endswith((".", ")")) and "``" not in first and ":class:" not in first


def test_docs_table_is_the_docstring():
    assert config.fields_markdown() in (ROOT / "docs" / "policies.md").read_text()
