"""bench.synthetic: the shapes the docs list are the shapes built (their parameter counts, from the meta device)."""

import re

from bench.synthetic import SHAPES, parameters_of
from tests.helpers import ROOT


def test_the_docs_table_states_each_shapes_parameters():
    rows = re.findall(r"^\| `([^`]+)`(?:, `[^`]+`)? \| (\w+) \| ([\d.]+)([MB]) \|", (ROOT / "docs" / "synthetic.md").read_text(),
                      re.M)
    assert {name for name, *_ in rows} == {name for name, s in SHAPES.items() if s.draft is not None}
    for name, family, number, unit in rows:
        assert SHAPES[name].family == family
        built = parameters_of(name) / (1e9 if unit == "B" else 1e6)
        assert round(built, len(number.partition(".")[2])) == float(number), (name, built)
