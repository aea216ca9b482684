"""Config values a review used to break the loader: a run name that escapes its folders, and a YAML alias bomb
under an unknown key whose error message tried to print it whole."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from forge_core.config import ConfigError, load_config

BOMB = textwrap.dedent(
    """
    a: &a ["x", "x", "x", "x", "x", "x", "x", "x", "x"]
    b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
    c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
    d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
    e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
    f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
    g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]
    h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]
    i: &i [*h, *h, *h, *h, *h, *h, *h, *h, *h]
    """
)


@pytest.mark.fault(
    fault="a 425-byte YAML alias bomb (9 levels of 9 references) as the value of unknown keys",
    where="forge_core.config.load_config (forgeflow validate, every flow start)",
    checked="the ConfigError names the keys with a bounded rendering of the value, at once, instead of "
    "formatting 9^9 elements",
)
def test_an_alias_bomb_under_an_unknown_key_is_refused_with_a_short_message(tmp_path, fault_row):
    config = tmp_path / "bomb.yaml"
    config.write_text(BOMB)
    assert len(BOMB.encode()) < 450
    probe = (
        "import sys\nfrom forge_core.config import ConfigError, load_config\n"
        "try:\n    load_config(sys.argv[1])\nexcept ConfigError as error:\n    text = str(error)\n"
        "    print(len(text), 'i=' in text and 'unknown key' in text)\n"
    )
    # A bound for safety only (an unbounded rendering of the value takes minutes and gigabytes).
    done = subprocess.run([sys.executable, "-c", probe, str(config)], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    length, names_the_key = done.stdout.split()
    assert names_the_key == "True", done.stdout
    assert int(length) < 8000, length
    fault_row.fact(f"a {length}-character message")


@pytest.mark.fault(
    fault="`name` set to a path: `a/b`, `../../..`, `/etc`, an empty string",
    where="forge_core.config.load_config (the run name names folders under logging.dir and in the store)",
    checked="each is a ConfigError naming the field, the value and the allowed form; plain names still load",
)
@pytest.mark.parametrize("name", ["a/b", "../../..", "/etc", "", ".hidden", "x" * 200])
def test_a_run_name_that_is_a_path_is_refused(name, fault_row):
    with pytest.raises(ConfigError, match=r"name=.*letters, digits"):
        load_config("configs/tiny_test.yaml", [f"name={name!s}" if name else "name=''"])
    assert load_config("configs/tiny_test.yaml", ["name=run-2.b_c"]).name == "run-2.b_c"
