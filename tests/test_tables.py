"""core/tables.py: the markdown tables of evaluate's and the study's report.md."""

from core.tables import header, row, table


def test_a_table_is_its_header_its_rule_and_its_rows_cells_as_given():
    lines = table(("run", "ECE", "T"), [("ce-s0", "1.23", "1.50!"), ("csm-s0", "0.98", "")])
    assert lines == [
        "| run | ECE | T |",
        "|---|---|---|",
        "| ce-s0 | 1.23 | 1.50! |",
        "| csm-s0 | 0.98 |  |",  # an empty cell keeps its two spaces
    ]


def test_an_empty_heading_is_a_narrow_cell_and_every_column_gets_a_rule():
    assert header(("", "metric", "")) == ["| | metric | |", "|---|---|---|"]
    assert row([]) == "|  |" and table(("a",), []) == ["| a |", "|---|"]
