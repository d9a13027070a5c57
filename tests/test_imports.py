"""The package's import graph: no module of oelm_core imports itself through others.

A cycle makes the order in which modules first load decide whether a name exists yet, and says
that two concepts were never separated. The graph is read from the source (every import
statement, those inside functions too, as they run when called): no package is imported.
"""

from import_graph import cycles, import_graph


def test_the_graph_reader_finds_a_cycle_it_is_given():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    real = import_graph()
    assert "oelm_core.runner.plan" in real["oelm_core.runner.local"]  # read from the source


def test_oelm_core_has_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" -> ".join(c + [c[0]]) for c in found)
