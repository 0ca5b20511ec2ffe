"""The statement guard's normalization: what runs is the checked text with every gap collapsed to one space."""

from __future__ import annotations

import contextlib
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from argus.core.errors import SinkError
from argus.sinks.sql_guard import MAX_STATEMENT_BYTES, StatementRefusedError, check_statement, prepare_statement
from tests.unit.test_fuzz_query import SQL_CHARS

BUDGET = settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


def test_examples() -> None:
    assert prepare_statement("SELECT 1" + " " * 200_000 + "+ 1").text == "SELECT 1 + 1"
    stmt = prepare_statement("select 1.5,\ta.b /* c */ -- x\n FROM t\r\nFORMAT JSONEachRow ;")
    assert (stmt.text, stmt.format) == ("select 1.5, a.b FROM t FORMAT JSONEachRow", "JSONEachRow")
    stmt = prepare_statement("SELECT 'a  b' ,\"x  y\" FORMAT  Native")
    assert (stmt.text, stmt.format) == ("SELECT 'a  b' ,\"x  y\" FORMAT Native", "Native")
    assert prepare_statement("SELECT 1-/**/-2").text == "SELECT 1- -2"  # a gap is a space, never nothing
    assert prepare_statement("SELECT format FROM t").format is None
    assert prepare_statement("SELECT 1 FORMAT 'x'").format is None


def test_bounds() -> None:
    t0 = time.monotonic()
    prepare_statement("SELECT 1" + " " * 1_000_000 + "+ 1")  # linear: a megabyte of spaces in well under 1 s
    assert time.monotonic() - t0 < 2
    with pytest.raises(StatementRefusedError) as info:
        prepare_statement("SELECT '" + "x" * MAX_STATEMENT_BYTES + "'")
    assert info.value.code == 393
    for sql, code in (("DROP TABLE t", 164), ("SELECT 1; SELECT 2", 164), ("SELECT file('x')", 497),
                      ("SELECT 1 INTO OUTFILE 'x'", 497), ("SELECT 'x", 62)):
        with pytest.raises(StatementRefusedError) as info:
            prepare_statement(sql)
        assert info.value.code == code, sql


@BUDGET
@given(st.one_of(st.text(max_size=200), st.lists(SQL_CHARS, max_size=60).map("".join)))
def test_normalized_text_is_checked_the_same_and_stable(sql: str) -> None:
    with contextlib.suppress(SinkError):
        stmt = prepare_statement(sql)
        check_statement(stmt.text)  # what runs passes the guard too
        again = prepare_statement(stmt.text)
        assert again == stmt  # normalizing is idempotent
        if not any(q in stmt.text for q in "'\"`"):  # outside quoted text, gaps are single spaces
            assert "  " not in stmt.text and stmt.text == stmt.text.strip()


@pytest.mark.parametrize("sql", [
    "SELECT * FROM system.disks", "SELECT path FROM `system`.`disks`", 'SELECT * FROM "system" . "parts"',
    "SELECT data_paths FROM system.tables", "SELECT * FROM SYSTEM.STORAGE_POLICIES",
    "SELECT count() FROM generateRandom('a String')", "SELECT * FROM loop(numbers(3))",
    "SELECT * FROM merge('system', '^disks$')", "WITH x AS (SELECT * FROM system.query_log) SELECT 1",
])
def test_statements_that_show_the_machine_or_cost_unbounded_work_are_refused(sql: str) -> None:
    """system.disks showed the data path; generateRandom and loop ran 50 s of CPU on the sink's machine."""
    with pytest.raises(StatementRefusedError) as info:
        prepare_statement(sql)
    assert info.value.code == 497


def test_harmless_system_tables_and_discovery_stay_served() -> None:
    for sql in ("SELECT * FROM system.one", "SELECT number FROM system.numbers LIMIT 3", "SHOW TABLES FROM argus",
                "SELECT name FROM system.functions LIMIT 1", "SELECT uniqMerge(x) FROM t", "DESCRIBE argus.findings"):
        prepare_statement(sql)
